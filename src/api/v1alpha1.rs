//! `DataPipeline` (stoker.dev/v1alpha1): spec, status and the CEL rules the API server enforces.
//!
//! Every string and list has a bound so that the CEL rules pass the API server's cost check; each
//! cross-field rule carries a message that names the field a user has to fix.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{ResourceRequirements, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use stoker_contract::IndexFiles;

/// A declarative data-loading pipeline: where the images live, how they are decoded and batched,
/// and the decoder fleet that feeds the trainer pods labelled `stoker.dev/pipeline: <name>`.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "stoker.dev",
    version = "v1alpha1",
    kind = "DataPipeline",
    plural = "datapipelines",
    singular = "datapipeline",
    shortname = "dp",
    namespaced,
    cel,
    status = "DataPipelineStatus",
    derive = "PartialEq",
    doc = "A fleet of stoker-loader decoders that feeds the trainer pods labelled `stoker.dev/pipeline: <name>` with decoded, batched images from S3.",
    // `kubectl scale dp NAME --replicas N` sets the fixed decoder count (mode fixed; the CEL
    // rules refuse it in the other modes) and reads back the ready decoders.
    scale(
        spec_replicas_path = ".spec.autoscaling.replicas",
        status_replicas_path = ".status.decoders.ready"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Decoders",
        type_ = "integer",
        description = "Ready decoder pods",
        json_path = ".status.decoders.ready"
    ),
    printcolumn(
        name = "Desired",
        type_ = "integer",
        description = "Decoder pods wanted",
        json_path = ".status.decoders.desired"
    ),
    printcolumn(
        name = "Trainers",
        type_ = "integer",
        description = "Trainer pods with the loader sidecar",
        json_path = ".status.trainers.injected"
    ),
    printcolumn(
        name = "Data-Wait",
        type_ = "number",
        description = "Share of trainer wall time spent waiting for data (%)",
        json_path = ".status.observed.dataWaitPercent"
    ),
    printcolumn(
        name = "Samples/s",
        type_ = "number",
        description = "Samples delivered to the trainers per second",
        json_path = ".status.observed.samplesPerSecond"
    ),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    validation = kube::core::Rule::new("self.metadata.name.size() <= 40 && self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')").message("metadata.name must be a DNS label of at most 40 characters starting with a letter: it prefixes the decoder pods, Service and labels")
)]
#[x_kube(
    validation = kube::core::Rule::new(
        "self.autoscaling.mode != 'fixed' || (has(self.autoscaling.replicas) && self.autoscaling.replicas >= self.decoders.minReplicas && self.autoscaling.replicas <= self.decoders.maxReplicas)"
    ).message("autoscaling.replicas is required when autoscaling.mode is fixed and must lie between decoders.minReplicas and decoders.maxReplicas").field_path(".autoscaling.replicas"),
    validation = rules::shared_memory_holds_the_ring(),
    validation = rules::batch_fits_one_reply(),
)]
#[serde(rename_all = "camelCase")]
pub struct DataPipelineSpec {
    /// Where the samples live.
    pub source: Source,
    /// How each image is resized before batching.
    pub transform: Transform,
    /// How samples are grouped; immutable because running trainers' epoch plans depend on it.
    #[x_kube(
        validation = kube::core::Rule::new("self == oldSelf").message("batch is immutable: running trainers' epoch order depends on it; create a new DataPipeline instead"),
        validation = rules::batch_size(),
    )]
    pub batch: Batch,
    /// The trainer side: prefetch depth, shared-memory ring, GPU placement.
    #[serde(default)]
    pub trainer: Trainer,
    /// The decoder fleet the operator runs.
    #[serde(default)]
    pub decoders: Decoders,
    /// How the decoder count is chosen.
    #[serde(default)]
    pub autoscaling: Autoscaling,
}

/// The data source: objects under `s3.prefix` (one image each), the samples a `manifest`
/// lists, `webDataset` shards, or `parquet` files.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new("!has(self.manifest) || !has(self.webDataset)").message("source.manifest and source.webDataset are two kinds of source: name one"))]
#[x_kube(validation = kube::core::Rule::new("!has(self.webDataset) || self.webDataset.shards.startsWith('s3://' + self.s3.bucket + '/' + (has(self.s3.prefix) ? self.s3.prefix : ''))").message("source.webDataset.shards must lie in source.s3.bucket under source.s3.prefix: the decoders read nothing else"))]
#[x_kube(validation = kube::core::Rule::new("!has(self.parquet) || (!has(self.manifest) && !has(self.webDataset))").message("source.parquet is a kind of source of its own: name it without source.manifest or source.webDataset"))]
#[x_kube(validation = kube::core::Rule::new("!has(self.parquet) || self.parquet.files.startsWith('s3://' + self.s3.bucket + '/' + (has(self.s3.prefix) ? self.s3.prefix : ''))").message("source.parquet.files must lie in source.s3.bucket under source.s3.prefix: the decoders read nothing else"))]
pub struct Source {
    pub s3: S3Source,
    /// Optional manifest object (`s3://bucket/key.jsonl`): one sample key plus caption/label per line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 6, max = 1100))]
    #[x_kube(validation = kube::core::Rule::new("self.startsWith('s3://')").message("source.manifest must be an s3:// URL, e.g. s3://bucket/train.jsonl"))]
    pub manifest: Option<String>,
    /// WebDataset tar shards, planned through their index.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub web_dataset: Option<WebDataset>,
    /// Parquet files with the image bytes in a column, planned through their index.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parquet: Option<ParquetSource>,
}

/// What a source planned through a dataset index is built from (`webDataset`, `parquet`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IndexedDataset<'a> {
    /// What kind of files `stoker-loader index` reads, and which.
    pub kind: IndexFiles,
    pub files: &'a str,
    pub index: &'a str,
    pub shuffle_window: Option<u32>,
    /// Parquet only: the image column and the metadata columns.
    pub image_column: Option<&'a str>,
    pub columns: &'a [String],
}

impl Source {
    /// The dataset index this source plans over, if it is sharded.
    pub fn indexed(&self) -> Option<IndexedDataset<'_>> {
        if let Some(w) = &self.web_dataset {
            return Some(IndexedDataset {
                kind: IndexFiles::Shards,
                files: &w.shards,
                index: &w.index,
                shuffle_window: w.shuffle_window,
                image_column: None,
                columns: &[],
            });
        }
        self.parquet.as_ref().map(|p| IndexedDataset {
            kind: IndexFiles::Parquet,
            files: &p.files,
            index: &p.index,
            shuffle_window: p.shuffle_window,
            image_column: p.image_column.as_deref(),
            columns: &p.columns,
        })
    }
}

/// Parquet files holding each image's bytes in a column (Hugging Face datasets' layout: an
/// `image` struct of `bytes` and `path`; or a plain binary column), one sample per row, with
/// other columns carried to the trainer as the sample's metadata. Sidecars plan over the
/// dataset index; decoders range-read the data page holding each row, so files written with
/// small data pages (pyarrow's `data_page_size` near one image) read the fewest bytes.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ParquetSource {
    /// The files: a brace pattern (`s3://bucket/data/train-{00000..00099}.parquet`) or a
    /// prefix ending in `/` for every `.parquet` under it. In `source.s3.bucket`.
    #[schemars(length(min = 6, max = 1100))]
    #[x_kube(validation = kube::core::Rule::new("self.startsWith('s3://')").message("source.parquet.files must be an s3:// URL, e.g. s3://bucket/data/train-{00000..00099}.parquet"))]
    pub files: String,
    /// The column of image bytes (default `image`): binary, or a struct whose `bytes` field
    /// holds them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 256))]
    pub image_column: Option<String>,
    /// Top-level columns carried with each sample as its metadata (caption, label, ...).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(min = 1, max = 256)))]
    pub columns: Vec<String>,
    /// Where the dataset index is (`s3://bucket/prefix/`), as for `webDataset`: the summary
    /// plus one table per file (its pages and each row's metadata columns).
    #[schemars(length(min = 6, max = 1100))]
    #[x_kube(validation = kube::core::Rule::new("self.startsWith('s3://') && self.endsWith('/')").message("source.parquet.index must be an s3:// prefix ending in /, e.g. s3://indexes/captions/"))]
    pub index: String,
    /// Samples in the shard-aware shuffle's buffer (default 10,000), as for `webDataset`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1_000_000))]
    pub shuffle_window: Option<u32>,
}

/// WebDataset shards (`.tar` files whose members sharing a basename form one sample: the image
/// plus `.txt`, `.cls`, `.json` fields that travel with it to the trainer). Sidecars plan over
/// the dataset index, not a listing: O(shards) memory, and decoders range-read each batch's
/// samples from their shards.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct WebDataset {
    /// The shards: a brace pattern (`s3://bucket/laion/{00000..04095}.tar`) or a prefix ending
    /// in `/` for every `.tar` under it. In `source.s3.bucket`.
    #[schemars(length(min = 6, max = 1100))]
    #[x_kube(validation = kube::core::Rule::new("self.startsWith('s3://')").message("source.webDataset.shards must be an s3:// URL, e.g. s3://bucket/laion/{00000..04095}.tar"))]
    pub shards: String,
    /// Where the dataset index is, as `stoker-loader index --out` writes it
    /// (`s3://bucket/prefix/`): a summary of a few bytes per shard plus a per-shard offset
    /// table that sidecars range-read. Read with the pipeline's credentials; it may lie in
    /// another bucket, so the data bucket's credentials can stay read-only.
    #[schemars(length(min = 6, max = 1100))]
    #[x_kube(validation = kube::core::Rule::new("self.startsWith('s3://') && self.endsWith('/')").message("source.webDataset.index must be an s3:// prefix ending in /, e.g. s3://indexes/laion/"))]
    pub index: String,
    /// Samples in the shard-aware shuffle's buffer (default 10,000): each epoch shuffles the
    /// shard order, then draws samples at random from a buffer this large. Larger mixes
    /// better and costs each sidecar 8 bytes per sample per rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1_000_000))]
    pub shuffle_window: Option<u32>,
}

/// An S3 (or S3-compatible) bucket and prefix.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct S3Source {
    /// Bucket name; immutable, since a trainer mid-epoch cannot switch datasets.
    #[schemars(
        length(min = 3, max = 63),
        regex(pattern = r"^[a-z0-9][a-z0-9.\-]*[a-z0-9]$")
    )]
    #[x_kube(validation = kube::core::Rule::new("self == oldSelf").message("source.s3.bucket is immutable: create a new DataPipeline for another dataset"))]
    pub bucket: String,
    /// Key prefix of the samples.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub prefix: Option<String>,
    /// Endpoint URL for S3-compatible stores (MinIO, Ceph); AWS when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 8, max = 2048))]
    #[x_kube(validation = kube::core::Rule::new("isURL(self) && url(self).getScheme() in ['http', 'https'] && url(self).getHostname() != ''").message("source.s3.endpoint must be an http:// or https:// URL with a host, e.g. http://minio.storage:9000"))]
    pub endpoint: Option<String>,
    /// Region, e.g. us-east-1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 64), regex(pattern = r"^[a-z0-9\-]+$"))]
    pub region: Option<String>,
    /// Path-style addressing (`endpoint/bucket/key`), needed by most S3-compatible stores.
    #[serde(default)]
    pub force_path_style: bool,
    /// Secret holding `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY` (and optionally
    /// `AWS_SESSION_TOKEN`); exposed as environment to decoders and sidecars.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_secret_ref: Option<SecretRef>,
    /// Let decoders and sidecars take credentials from the node's instance metadata (the
    /// node's IAM role). Off by default: every pod on the node shares that role, so a pipeline
    /// names its access with a Secret (or the trainer's web identity) instead.
    #[serde(default)]
    pub use_instance_metadata: bool,
}

/// A Secret in the pipeline's namespace.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct SecretRef {
    /// Name of the Secret.
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    )]
    pub name: String,
}

/// Per-sample transform.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Transform {
    pub resize: Resize,
}

/// How an image is brought to the model's input size.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = kube::core::Rule::new("self.mode == 'qwenSmart' || (has(self.width) && has(self.height))").message("transform.resize.width and transform.resize.height are required for mode crop and fit"),
    validation = kube::core::Rule::new("self.mode != 'qwenSmart' || (!has(self.width) && !has(self.height))").message("transform.resize.width and height do not apply to mode qwenSmart: use minPixels and maxPixels"),
    validation = kube::core::Rule::new("self.mode == 'qwenSmart' || (!has(self.patchFactor) && !has(self.minPixels) && !has(self.maxPixels))").message("transform.resize.patchFactor, minPixels and maxPixels apply only to mode qwenSmart"),
    validation = kube::core::Rule::new("self.mode != 'qwenSmart' || (has(self.minPixels) && has(self.maxPixels) && self.minPixels <= self.maxPixels)").message("mode qwenSmart needs transform.resize.minPixels <= transform.resize.maxPixels"),
    validation = rules::output_pixels(),
    validation = rules::max_pixels(),
    validation = kube::core::Rule::new("!has(self.patchFactor) || !has(self.maxPixels) || self.patchFactor * self.patchFactor <= self.maxPixels").message("transform.resize.patchFactor² must not exceed transform.resize.maxPixels: no image of a single patch would fit"),
)]
pub struct Resize {
    pub mode: ResizeMode,
    /// Output width in pixels (crop, fit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 8192))]
    pub width: Option<i64>,
    /// Output height in pixels (crop, fit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 8192))]
    pub height: Option<i64>,
    /// qwenSmart: both sides are rounded to a multiple of this (the ViT patch size × merge size).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 256))]
    pub patch_factor: Option<i64>,
    /// qwenSmart: lower bound on width × height after resizing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 67108864))]
    pub min_pixels: Option<i64>,
    /// qwenSmart: upper bound on width × height after resizing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 67108864))]
    pub max_pixels: Option<i64>,
}

impl Default for Resize {
    fn default() -> Self {
        Self {
            mode: ResizeMode::Crop,
            width: Some(224),
            height: Some(224),
            patch_factor: None,
            min_pixels: None,
            max_pixels: None,
        }
    }
}

pub use stoker_contract::{GpuPlacement, ResizeMode};

/// Batching.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Batch {
    /// Samples per batch.
    #[schemars(range(min = 1, max = 65536))]
    pub size: i64,
    /// Seed of the per-epoch shuffle; the order is a pure function of (seed, epoch, rank, world size).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 9007199254740991_i64))]
    pub shuffle_seed: Option<i64>,
    /// Drop the last incomplete batch of an epoch.
    #[serde(default)]
    pub drop_last: bool,
}

/// The trainer side of the pipeline.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Trainer {
    /// Batches the sidecar keeps decoded ahead of the trainer.
    #[serde(default = "default_prefetch")]
    #[schemars(range(min = 1, max = 1024))]
    pub prefetch_batches: i64,
    /// Size of one trainer process's shared-memory ring (a Kubernetes quantity, e.g. 2Gi); a
    /// trainer pod gets it once per local rank (torchrun's --nproc-per-node), in its
    /// memory-backed volume and on the sidecar's memory. Immutable because injected pods
    /// already carry it.
    #[serde(default = "default_shm")]
    #[schemars(length(min = 1, max = 32))]
    #[x_kube(
        validation = kube::core::Rule::new("isQuantity(self)").message("trainer.sharedMemory must be a quantity such as 2Gi"),
        validation = kube::core::Rule::new("self == oldSelf").message("trainer.sharedMemory is immutable: trainer pods already have their ring sized; create a new DataPipeline"),
    )]
    pub shared_memory: String,
    /// Where batches are placed for the trainer.
    #[serde(default)]
    pub gpu_placement: GpuPlacement,
}

impl Default for Trainer {
    fn default() -> Self {
        Self {
            prefetch_batches: default_prefetch(),
            shared_memory: default_shm(),
            gpu_placement: GpuPlacement::default(),
        }
    }
}

fn default_prefetch() -> i64 {
    4
}
fn default_shm() -> String {
    "1Gi".into()
}

/// The decoder fleet.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new("self.minReplicas <= self.maxReplicas").message("decoders.minReplicas must not exceed decoders.maxReplicas"))]
pub struct Decoders {
    /// Fewest decoder pods (the count in mode recommend, the floor in mode auto).
    #[serde(default = "default_min")]
    #[schemars(range(min = 0, max = 2000))]
    pub min_replicas: i32,
    /// Most decoder pods the autoscaler may run.
    #[serde(default = "default_max")]
    #[schemars(range(min = 1, max = 2000))]
    pub max_replicas: i32,
    /// Loader image; the operator's default when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    pub image: Option<String>,
    /// ServiceAccount the decoder pods run as, for cloud identity to S3 (IRSA, GKE workload
    /// identity); it must exist in the pipeline's namespace. Unset: a per-pipeline account
    /// with no permissions (`stoker-<name>-decoder`). Decoders mount no Kubernetes API token
    /// either way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    )]
    pub service_account_name: Option<String>,
    /// Resources of each decoder pod (default: 1 CPU, 1Gi requested).
    /// The bounds (not in k8s-openapi's schema) keep the quantity rules within the API server's
    /// CEL cost budget.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("properties" = {
        "claims": {"type": "array", "maxItems": 16, "description": "Dynamic resource claims of the pod each decoder uses.",
            "items": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "maxLength": 253, "description": "Name of one of the pod's resourceClaims."},
            "request": {"type": "string", "maxLength": 253, "description": "One request of that claim; empty uses all of them."}}}},
        "limits": {"type": "object", "maxProperties": 16, "description": "Most each decoder may use.",
            "additionalProperties": {"x-kubernetes-int-or-string": true, "maxLength": 64}},
        "requests": {"type": "object", "maxProperties": 16, "description": "What each decoder is scheduled with.",
            "additionalProperties": {"x-kubernetes-int-or-string": true, "maxLength": 64}}
    }))]
    #[x_kube(
        validation = kube::core::Rule::new(rules::QUANTITIES_PARSE).message("decoders.resources.requests and decoders.resources.limits must be non-negative quantities such as 500m, 2 or 4Gi"),
        validation = kube::core::Rule::new(rules::REQUESTS_WITHIN_LIMITS).message("decoders.resources.requests must not exceed decoders.resources.limits for the same resource"),
    )]
    pub resources: Option<ResourceRequirements>,
    /// Node labels decoder pods must land on.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 32, "additionalProperties" = {"type": "string", "maxLength": 63}))]
    #[x_kube(
        validation = rules::node_selector_keys(),
        validation = rules::node_selector_values(),
    )]
    pub node_selector: BTreeMap<String, String>,
    /// Taints decoder pods tolerate.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32), extend("items" = {"type": "object", "properties": {
        "key": {"type": "string", "maxLength": 317, "description": "Taint key; empty with operator Exists matches every taint."},
        "operator": {"type": "string", "maxLength": 16, "description": "Exists or Equal (the default)."},
        "value": {"type": "string", "maxLength": 63, "description": "Taint value (operator Equal)."},
        "effect": {"type": "string", "maxLength": 32, "description": "NoSchedule, PreferNoSchedule or NoExecute; empty matches all."},
        "tolerationSeconds": {"type": "integer", "format": "int64", "description": "How long a NoExecute taint is tolerated."}
    }}))]
    #[x_kube(
        validation = rules::toleration_keys(),
        validation = rules::toleration_values(),
        validation = kube::core::Rule::new("self.all(t, (!has(t.effect) || t.effect in ['', 'NoSchedule', 'PreferNoSchedule', 'NoExecute']) && (!has(t.operator) || t.operator in ['', 'Exists', 'Equal']) && (!has(t.operator) || t.operator != 'Exists' || !has(t.value) || t.value == ''))").message("decoders.tolerations: effect must be NoSchedule, PreferNoSchedule or NoExecute, operator Exists or Equal, and an Exists toleration has no value"),
    )]
    pub tolerations: Vec<Toleration>,
    #[serde(default)]
    pub spread: Spread,
    /// How long a decoder taken out of discovery keeps serving in-flight batches before deletion.
    #[serde(default = "default_drain")]
    #[schemars(range(min = 0, max = 3600))]
    pub drain_seconds: i32,
}

impl Default for Decoders {
    fn default() -> Self {
        Self {
            min_replicas: default_min(),
            max_replicas: default_max(),
            image: None,
            service_account_name: None,
            resources: None,
            node_selector: BTreeMap::new(),
            tolerations: Vec::new(),
            spread: Spread::default(),
            drain_seconds: default_drain(),
        }
    }
}

fn default_min() -> i32 {
    1
}
fn default_max() -> i32 {
    16
}
fn default_drain() -> i32 {
    30
}

/// How decoders are spread over nodes.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Spread {
    /// Most pods one topology domain may have over the least loaded one.
    #[serde(default = "default_skew")]
    #[schemars(range(min = 1, max = 100))]
    pub max_skew: i32,
    /// Also spread evenly over `topology.kubernetes.io/zone`.
    #[serde(default)]
    pub zones: bool,
}

impl Default for Spread {
    fn default() -> Self {
        Self {
            max_skew: default_skew(),
            zones: false,
        }
    }
}

fn default_skew() -> i32 {
    1
}

/// Decoder autoscaling.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = kube::core::Rule::new("self.mode == 'fixed' || !has(self.replicas)").message("autoscaling.replicas applies only when autoscaling.mode is fixed"),
    validation = kube::core::Rule::new("self.maxScaleUpStep >= 1 && self.maxScaleDownStep >= 1").message("autoscaling.maxScaleUpStep and maxScaleDownStep must be at least 1"),
)]
pub struct Autoscaling {
    #[serde(default)]
    pub mode: AutoscalingMode,
    /// Fixed decoder count when mode is fixed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 2000))]
    pub replicas: Option<i32>,
    /// Share of wall time a trainer may wait for data before the fleet grows.
    #[serde(default = "default_wait")]
    #[schemars(range(min = 1, max = 100))]
    pub target_data_wait_percent: i32,
    /// No node's NIC is pushed past this utilization.
    #[serde(default = "default_nic")]
    #[schemars(range(min = 1, max = 100))]
    pub max_nic_utilization_percent: i32,
    /// Seconds a higher recommendation must hold before the fleet grows.
    #[serde(default)]
    #[schemars(range(min = 0, max = 3600))]
    pub scale_up_stabilization_seconds: i32,
    /// Seconds the fleet keeps the highest recommendation of the window before it shrinks.
    #[serde(default = "default_down_window")]
    #[schemars(range(min = 0, max = 86400))]
    pub scale_down_stabilization_seconds: i32,
    /// Most decoders added in one decision.
    #[serde(default = "default_step")]
    #[schemars(range(min = 1, max = 2000))]
    pub max_scale_up_step: i32,
    /// Most decoders removed in one decision.
    #[serde(default = "default_step")]
    #[schemars(range(min = 1, max = 2000))]
    pub max_scale_down_step: i32,
}

impl Default for Autoscaling {
    fn default() -> Self {
        Self {
            mode: AutoscalingMode::default(),
            replicas: None,
            target_data_wait_percent: default_wait(),
            max_nic_utilization_percent: default_nic(),
            scale_up_stabilization_seconds: 0,
            scale_down_stabilization_seconds: default_down_window(),
            max_scale_up_step: default_step(),
            max_scale_down_step: default_step(),
        }
    }
}

fn default_wait() -> i32 {
    5
}
fn default_nic() -> i32 {
    80
}
fn default_down_window() -> i32 {
    300
}
fn default_step() -> i32 {
    8
}

/// Whether the autoscaler acts.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub enum AutoscalingMode {
    /// Scale between decoders.minReplicas and maxReplicas.
    #[default]
    Auto,
    /// Compute and report decisions in status and Events, but keep decoders.minReplicas.
    Recommend,
    /// Keep autoscaling.replicas decoders (the off switch). Spelled `fixed` on the wire: YAML 1.1
    /// parsers, kubectl's among them, read a bare `off` as the boolean false.
    #[serde(rename = "fixed")]
    Off,
}

/// Observed state of a DataPipeline.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct DataPipelineStatus {
    /// The metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Ready, Degraded, and the autoscaler's Starved, NetworkSaturated, S3Throttled, MetricsUnavailable.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub conditions: Vec<Condition>,
    #[serde(default)]
    pub decoders: DecoderFleetStatus,
    #[serde(default)]
    pub trainers: TrainerStatus,
    /// Signals the autoscaler read last.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed: Option<ObservedSignals>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_scale: Option<ScaleRecord>,
    /// The dataset index of a `webDataset` source, and the Job that builds it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<IndexStatus>,
    /// The certificate the operator last wrote into `<name>-decoders-tls`: how the operator
    /// knows when to renew it without reading the Secret.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub certificate: Option<CertificateStatus>,
}

/// The pipeline's mTLS certificate as issued (no key material: what anyone may read).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CertificateStatus {
    pub not_before: Time,
    pub not_after: Time,
    /// SHA-256 (hex) of the trust bundle it was issued with.
    #[schemars(length(max = 64))]
    pub ca_sha256: String,
    /// The name it was issued for (the decoder Service's DNS name).
    #[schemars(length(max = 512))]
    pub name: String,
}

/// Where a pipeline's dataset index stands.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct IndexStatus {
    /// The Job that builds it (`<pipeline>-index-<hash of shards, index, reindex annotation>`).
    pub job: String,
    /// Building, Ready or Failed.
    pub phase: String,
    /// Where the index is (`source.webDataset.index`).
    pub location: String,
    /// Shards indexed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shards: Option<i64>,
    /// Samples indexed: what an epoch delivers across the ranks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples: Option<i64>,
    /// Bytes of the shards read to build it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard_bytes: Option<i64>,
    /// Bytes of the per-sample offset table (8 per sample, plus 8 per shard).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offsets_bytes: Option<i64>,
    /// Samples left out (cut or malformed members; the Job's log names each).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub problems: Option<i64>,
    /// What went wrong, while Failed; or why no figures are known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// Decoder pods.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct DecoderFleetStatus {
    /// Decoder pods the operator wants now (fixed count, minimum, or the autoscaler's decision).
    pub desired: i32,
    /// Decoder pods ready and serving.
    pub ready: i32,
    /// Pods taken out of discovery, waiting for their drain period to end.
    pub draining: i32,
    /// Distinct nodes running a ready decoder.
    pub nodes: i32,
}

/// Trainer pods that opted in with `stoker.dev/pipeline`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct TrainerStatus {
    /// Trainer pods seen (not terminated).
    pub pods: i32,
    /// Of those, pods carrying the loader sidecar.
    pub injected: i32,
    /// World size the trainers declare (largest `stoker.dev/world-size` seen), else the pod count.
    pub world_size: i32,
    /// Distinct ranks the trainer pods declare (`RANK`, `stoker.dev/rank`, or an Indexed Job's
    /// completion index), sorted; a gap shows a missing rank of an elastic job.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 4096))]
    pub ranks: Vec<i32>,
}

/// Signals read from Prometheus.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ObservedSignals {
    /// Share of wall time the trainer rank that gates the step waited for data (%).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_wait_percent: Option<f64>,
    /// Mean GPU utilization of the trainer pods (%), when dcgm-exporter reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_utilization_percent: Option<f64>,
    /// Samples the sidecars delivered to the trainers per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples_per_second: Option<f64>,
    /// Utilization of the busiest NIC among the pipeline's nodes (%).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_nic_utilization_percent: Option<f64>,
}

/// The last change of the decoder count and why.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ScaleRecord {
    /// When the count changed.
    pub time: Time,
    /// Decoder count before.
    pub from: i32,
    /// Decoder count after.
    pub to: i32,
    /// The decision's reason, in numbers (data wait, demand, per-decoder rate).
    #[schemars(length(max = 1024))]
    pub reason: String,
}

/// Rules whose limits come from `stoker_contract`, so the CRD refuses exactly what a decoder,
/// the decode RPC or the pod API would refuse later, silently, in the fleet.
mod rules {
    use kube::core::Rule;
    use stoker_contract::{
        HELD_BATCHES, MAX_BATCH_PIXEL_BYTES, MAX_BATCH_SAMPLES, MAX_GRPC_MESSAGE_BYTES,
        MAX_OUTPUT_PIXELS, RGB_BYTES, ring_bytes_cel,
    };

    /// A label value: at most 63 characters, alphanumerics, `-`, `_`, `.`, alphanumeric at both
    /// ends (the pod API's rule).
    const LABEL_VALUE: &str = "^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$";
    /// A qualified name: an optional DNS-subdomain prefix and `/`, then a name of at most 63.
    const QUALIFIED_NAME: &str = "^([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$";

    /// Quantities are int-or-string: `string()` takes both to the text `quantity()` parses.
    pub const QUANTITIES_PARSE: &str = "(!has(self.requests) || self.requests.all(k, isQuantity(string(self.requests[k])) && quantity(string(self.requests[k])).compareTo(quantity('0')) >= 0)) && (!has(self.limits) || self.limits.all(k, isQuantity(string(self.limits[k])) && quantity(string(self.limits[k])).compareTo(quantity('0')) >= 0))";
    pub const REQUESTS_WITHIN_LIMITS: &str = "!has(self.requests) || !has(self.limits) || self.requests.all(k, !(k in self.limits) || !isQuantity(string(self.requests[k])) || !isQuantity(string(self.limits[k])) || quantity(string(self.requests[k])).compareTo(quantity(string(self.limits[k]))) <= 0)";

    fn rule(rule: String, message: String) -> Rule {
        Rule::new(rule).message(message.as_str())
    }

    fn mib(bytes: u64) -> u64 {
        bytes >> 20
    }

    /// The sample pixels of the output, whichever the mode (0 while a rule above refuses it).
    pub const OUTPUT_PIXELS: &str = "self.transform.resize.mode == 'qwenSmart' ? (has(self.transform.resize.maxPixels) ? self.transform.resize.maxPixels : 0) : (has(self.transform.resize.width) && has(self.transform.resize.height) ? self.transform.resize.width * self.transform.resize.height : 0)";

    /// `stoker_contract::ring_bytes` of the spec, rendered from the same constants.
    pub fn shared_memory_holds_the_ring() -> Rule {
        let ring = ring_bytes_cel(
            "self.trainer.prefetchBatches",
            "self.batch.size",
            OUTPUT_PIXELS,
        );
        rule(
            format!(
                "!isQuantity(self.trainer.sharedMemory) || quantity(self.trainer.sharedMemory).asApproximateFloat() >= {ring}"
            ),
            format!(
                "trainer.sharedMemory is too small for the ring: it must hold (trainer.prefetchBatches + {HELD_BATCHES} held by the trainer) × batch.size × (width × height, or maxPixels) × {RGB_BYTES} bytes"
            ),
        )
        .field_path(".trainer.sharedMemory")
    }

    pub fn batch_size() -> Rule {
        rule(
            format!("self.size <= {MAX_BATCH_SAMPLES}"),
            format!(
                "batch.size must be at most {MAX_BATCH_SAMPLES}: a decoder refuses larger batches"
            ),
        )
    }

    pub fn batch_fits_one_reply() -> Rule {
        rule(
            format!("self.batch.size * {RGB_BYTES} * ({OUTPUT_PIXELS}) <= {MAX_BATCH_PIXEL_BYTES}"),
            format!(
                "batch.size × (width × height, or maxPixels) × 3 bytes must be at most {MAX_BATCH_PIXEL_BYTES} ({} MiB): a batch travels in one gRPC reply of at most {} MiB",
                mib(MAX_BATCH_PIXEL_BYTES),
                mib(MAX_GRPC_MESSAGE_BYTES)
            ),
        )
        .field_path(".batch.size")
    }

    pub fn output_pixels() -> Rule {
        rule(
            format!(
                "!has(self.width) || !has(self.height) || self.width * self.height <= {MAX_OUTPUT_PIXELS}"
            ),
            format!(
                "transform.resize.width × height must be at most {MAX_OUTPUT_PIXELS} pixels, the largest output a decoder produces"
            ),
        )
    }

    pub fn max_pixels() -> Rule {
        rule(
            format!("!has(self.maxPixels) || self.maxPixels <= {MAX_OUTPUT_PIXELS}"),
            format!(
                "transform.resize.maxPixels must be at most {MAX_OUTPUT_PIXELS}, the largest output a decoder produces"
            ),
        )
    }

    pub fn node_selector_keys() -> Rule {
        rule(
            format!("self.all(k, k.size() <= 317 && k.matches('{QUALIFIED_NAME}'))"),
            "decoders.nodeSelector keys must be label keys: an optional DNS prefix and '/', then at most 63 alphanumerics, '-', '_' or '.'".into(),
        )
    }

    pub fn node_selector_values() -> Rule {
        rule(
            format!("self.all(k, self[k].size() <= 63 && self[k].matches('{LABEL_VALUE}'))"),
            "decoders.nodeSelector values must be label values: at most 63 alphanumerics, '-', '_' or '.', beginning and ending with an alphanumeric".into(),
        )
    }

    pub fn toleration_keys() -> Rule {
        rule(
            format!("self.all(t, !has(t.key) || t.key == '' || (t.key.size() <= 317 && t.key.matches('{QUALIFIED_NAME}')))"),
            "decoders.tolerations keys must be label keys: an optional DNS prefix and '/', then at most 63 alphanumerics, '-', '_' or '.'".into(),
        )
    }

    pub fn toleration_values() -> Rule {
        rule(
            format!("self.all(t, !has(t.value) || (t.value.size() <= 63 && t.value.matches('{LABEL_VALUE}')))"),
            "decoders.tolerations values must be label values: at most 63 alphanumerics, '-', '_' or '.', beginning and ending with an alphanumeric".into(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CROP: &str = include_str!("../../tests/fixtures/datapipeline-crop.yaml");
    const QWEN: &str = include_str!("../../tests/fixtures/datapipeline-qwen.yaml");

    fn crop() -> DataPipeline {
        serde_yaml::from_str(CROP).expect("fixture parses")
    }

    fn qwen() -> DataPipeline {
        serde_yaml::from_str(QWEN).expect("fixture parses")
    }

    /// The CEL message the object is rejected with (creation rules).
    fn rejected(dp: &DataPipeline) -> String {
        match dp.validate_cel() {
            Ok(()) => panic!("expected a CEL rejection for {:#?}", dp.spec),
            Err(e) => e.to_string(),
        }
    }

    fn rejected_update(new: &DataPipeline, old: &DataPipeline) -> String {
        match new.validate_cel_update(old) {
            Ok(()) => panic!("expected a CEL rejection of the update"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn fixtures_pass_every_rule() {
        crop().validate_cel().expect("crop fixture is valid");
        qwen().validate_cel().expect("qwen fixture is valid");
        crop()
            .validate_cel_update(&crop())
            .expect("unchanged update is valid");
    }

    #[test]
    fn name_must_be_a_short_dns_label() {
        let mut dp = crop();
        dp.metadata.name = Some("a".repeat(41));
        assert!(rejected(&dp).contains("metadata.name"));
        dp.metadata.name = Some("9lives".into());
        assert!(rejected(&dp).contains("metadata.name"));
    }

    #[test]
    fn min_replicas_must_not_exceed_max() {
        let mut dp = crop();
        dp.spec.decoders.min_replicas = 10;
        dp.spec.decoders.max_replicas = 5;
        assert!(rejected(&dp).contains("decoders.minReplicas must not exceed"));
    }

    #[test]
    fn crop_needs_width_and_height() {
        let mut dp = crop();
        dp.spec.transform.resize.height = None;
        assert!(rejected(&dp).contains("width and transform.resize.height are required"));
    }

    #[test]
    fn qwen_smart_rejects_width() {
        let mut dp = qwen();
        dp.spec.transform.resize.width = Some(448);
        assert!(rejected(&dp).contains("do not apply to mode qwenSmart"));
    }

    #[test]
    fn patch_factor_only_for_qwen_smart() {
        let mut dp = crop();
        dp.spec.transform.resize.patch_factor = Some(28);
        assert!(rejected(&dp).contains("apply only to mode qwenSmart"));
    }

    #[test]
    fn qwen_smart_needs_ordered_pixel_bounds() {
        let mut dp = qwen();
        dp.spec.transform.resize.min_pixels = Some(2_000_000);
        assert!(rejected(&dp).contains("minPixels <= transform.resize.maxPixels"));
        dp.spec.transform.resize.min_pixels = None;
        assert!(rejected(&dp).contains("minPixels <= transform.resize.maxPixels"));
    }

    #[test]
    fn examples_pass_every_rule() {
        for example in [
            include_str!("../../examples/objects.yaml"),
            include_str!("../../examples/manifest.yaml"),
            include_str!("../../examples/webdataset.yaml"),
            include_str!("../../examples/parquet.yaml"),
        ] {
            let dp: DataPipeline = serde_yaml::from_str(example).expect("example parses");
            dp.validate_cel().expect("example is valid");
        }
    }

    #[test]
    fn parquet_files_lie_where_decoders_read_and_exclude_other_kinds() {
        let pq: DataPipeline =
            serde_yaml::from_str(include_str!("../../examples/parquet.yaml")).expect("parses");
        let mut dp = pq.clone();
        dp.spec.source.manifest = Some("s3://captions/train.jsonl".into());
        assert!(rejected(&dp).contains("source.parquet is a kind of source of its own"));
        let mut dp = pq.clone();
        dp.spec.source.parquet.as_mut().expect("parquet").files =
            "s3://other/train/0.parquet".into();
        assert!(rejected(&dp).contains("source.parquet.files must lie in source.s3.bucket"));
        let indexed = pq.spec.source.indexed().expect("indexed");
        assert_eq!(indexed.kind, IndexFiles::Parquet);
        assert_eq!(indexed.columns, ["caption", "label"]);
    }

    #[test]
    fn web_dataset_shards_lie_where_decoders_read_and_exclude_a_manifest() {
        let wds: DataPipeline =
            serde_yaml::from_str(include_str!("../../examples/webdataset.yaml")).expect("parses");
        let mut dp = wds.clone();
        dp.spec.source.manifest = Some("s3://laion/train.jsonl".into());
        assert!(rejected(&dp).contains("source.manifest and source.webDataset"));
        for outside in [
            "s3://other/shards/{0..3}.tar",
            "s3://laion/elsewhere/{0..3}.tar",
            "s3://laionx/shards/0.tar",
        ] {
            let mut dp = wds.clone();
            dp.spec.source.web_dataset.as_mut().expect("wds").shards = outside.into();
            assert!(
                rejected(&dp).contains("source.webDataset.shards must lie in source.s3.bucket"),
                "{outside}"
            );
        }
        let mut dp = wds.clone();
        dp.spec.source.web_dataset.as_mut().expect("wds").index = "s3://laion-index/v1".into();
        assert!(rejected(&dp).contains("source.webDataset.index must be an s3:// prefix"));
        let mut dp = wds;
        dp.spec.source.s3.prefix = None;
        dp.validate_cel()
            .expect("without a prefix, anywhere in the bucket");
    }

    #[test]
    fn manifest_must_be_s3_url() {
        let mut dp = crop();
        dp.spec.source.manifest = Some("https://example.com/train.jsonl".into());
        assert!(rejected(&dp).contains("source.manifest must be an s3:// URL"));
    }

    #[test]
    fn endpoint_must_be_an_http_url_with_a_host() {
        let mut dp = crop();
        for bad in ["minio.storage:9000", "ftp://minio:21", "http://"] {
            dp.spec.source.s3.endpoint = Some(bad.into());
            assert!(
                rejected(&dp).contains("source.s3.endpoint must be an http:// or https:// URL"),
                "{bad}"
            );
        }
        for good in ["http://minio.storage:9000", "https://s3.example.com"] {
            dp.spec.source.s3.endpoint = Some(good.into());
            dp.validate_cel().expect(good);
        }
    }

    #[test]
    fn batch_size_is_what_a_decoder_accepts() {
        let mut dp = crop();
        dp.spec.transform.resize.width = Some(8);
        dp.spec.transform.resize.height = Some(8);
        dp.spec.trainer.shared_memory = "64Mi".into();
        dp.spec.batch.size = i64::try_from(stoker_contract::MAX_BATCH_SAMPLES).expect("fits");
        dp.validate_cel().expect("a batch at the decoder's limit");
        dp.spec.batch.size += 1;
        assert!(rejected(&dp).contains("batch.size must be at most 1024"));
    }

    #[test]
    fn output_pixels_are_what_a_decoder_produces() {
        let mut dp = crop();
        dp.spec.batch.size = 1;
        dp.spec.trainer.shared_memory = "1Gi".into();
        dp.spec.transform.resize.width = Some(4096);
        dp.spec.transform.resize.height = Some(4096);
        assert!(rejected(&dp).contains("width × height must be at most 12845056 pixels"));
        let mut q = qwen();
        q.spec.transform.resize.max_pixels = Some(20_000_000);
        assert!(rejected(&q).contains("transform.resize.maxPixels must be at most 12845056"));
        let mut q = qwen();
        q.spec.transform.resize.patch_factor = Some(256);
        q.spec.transform.resize.min_pixels = Some(1);
        q.spec.transform.resize.max_pixels = Some(1000);
        assert!(rejected(&q).contains("patchFactor² must not exceed"));
    }

    #[test]
    fn a_batch_must_fit_one_grpc_reply() {
        let mut dp = crop();
        dp.spec.trainer.shared_memory = "64Gi".into();
        // 1024 × 448 × 448 × 3 = 616 MB, far above the 240 MiB a reply carries in pixels.
        dp.spec.batch.size = 1024;
        assert!(rejected(&dp).contains("must be at most 251658240 (240 MiB)"));
        // 128 × 448 × 448 × 3 = 77 MB fits.
        dp.spec.batch.size = 128;
        dp.validate_cel().expect("a 77 MB batch fits one reply");
    }

    #[test]
    fn node_selector_must_be_labels() {
        let mut dp = crop();
        dp.spec
            .decoders
            .node_selector
            .insert("nvidia.com/gpu.present".into(), "true".into());
        dp.validate_cel().expect("a label");
        dp.spec
            .decoders
            .node_selector
            .insert("pool".into(), "a".repeat(64));
        assert!(rejected(&dp).contains("decoders.nodeSelector values must be label values"));
        dp.spec.decoders.node_selector.clear();
        dp.spec
            .decoders
            .node_selector
            .insert("bad key!".into(), "x".into());
        assert!(rejected(&dp).contains("decoders.nodeSelector keys must be label keys"));
    }

    #[test]
    fn tolerations_must_be_labels() {
        let toleration = |key: &str, operator: &str, value: Option<&str>| Toleration {
            key: Some(key.into()),
            operator: Some(operator.into()),
            value: value.map(Into::into),
            effect: Some("NoSchedule".into()),
            ..Toleration::default()
        };
        let mut dp = crop();
        dp.spec.decoders.tolerations = vec![toleration("gpu", "Equal", Some("a100"))];
        dp.validate_cel().expect("a toleration");
        dp.spec.decoders.tolerations = vec![toleration("gpu", "Equal", Some("not a label"))];
        assert!(rejected(&dp).contains("decoders.tolerations values must be label values"));
        dp.spec.decoders.tolerations = vec![toleration("gpu/x/y", "Exists", None)];
        assert!(rejected(&dp).contains("decoders.tolerations keys must be label keys"));
        dp.spec.decoders.tolerations = vec![toleration("gpu", "Exists", Some("a100"))];
        assert!(rejected(&dp).contains("an Exists toleration has no value"));
    }

    fn resources(requests: &[(&str, &str)], limits: &[(&str, &str)]) -> ResourceRequirements {
        use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
        let map = |kv: &[(&str, &str)]| {
            Some(
                kv.iter()
                    .map(|(k, v)| ((*k).to_string(), Quantity((*v).to_string())))
                    .collect(),
            )
        };
        ResourceRequirements {
            requests: map(requests),
            limits: map(limits),
            ..ResourceRequirements::default()
        }
    }

    #[test]
    fn decoder_resources_must_parse() {
        let mut dp = crop();
        dp.spec.decoders.resources = Some(resources(&[("cpu", "2")], &[("memory", "4Gi")]));
        dp.validate_cel().expect("quantities");
        dp.spec.decoders.resources = Some(resources(&[("cpu", "two")], &[]));
        assert!(rejected(&dp).contains("must be non-negative quantities"));
        dp.spec.decoders.resources = Some(resources(&[], &[("memory", "-1Gi")]));
        assert!(rejected(&dp).contains("must be non-negative quantities"));
    }

    #[test]
    fn decoder_requests_must_not_exceed_limits() {
        let mut dp = crop();
        dp.spec.decoders.resources = Some(resources(&[("cpu", "500m")], &[("cpu", "1")]));
        dp.validate_cel().expect("requests below limits");
        dp.spec.decoders.resources = Some(resources(&[("memory", "2Gi")], &[("memory", "1Gi")]));
        assert!(rejected(&dp).contains("requests must not exceed decoders.resources.limits"));
    }

    #[test]
    fn shared_memory_must_be_a_quantity() {
        let mut dp = crop();
        dp.spec.trainer.shared_memory = "lots".into();
        assert!(rejected(&dp).contains("trainer.sharedMemory must be a quantity"));
    }

    #[test]
    fn shared_memory_must_hold_the_ring() {
        // The ring exactly as the sidecar maps it: accepted at the bound, refused a byte below.
        let at_bound = |dp: &DataPipeline, pixels: i64| {
            let size = |v: i64| u64::try_from(v).expect("positive");
            stoker_contract::ring_bytes(
                size(dp.spec.trainer.prefetch_batches),
                size(dp.spec.batch.size),
                size(pixels),
            )
        };
        let mut dp = crop();
        let ring = at_bound(&dp, 448 * 448);
        // 10 slots × 32 × 448 × 448 × 3 bytes.
        assert_eq!(ring, 192_675_840);
        dp.spec.trainer.shared_memory = ring.to_string();
        dp.validate_cel().expect("a ring exactly at the bound fits");
        dp.spec.trainer.shared_memory = (ring - 1).to_string();
        assert!(rejected(&dp).contains("trainer.sharedMemory is too small"));
        let mut q = qwen();
        let ring = at_bound(&q, q.spec.transform.resize.max_pixels.expect("maxPixels"));
        q.spec.trainer.shared_memory = ring.to_string();
        q.validate_cel()
            .expect("a qwenSmart ring at the bound fits");
        q.spec.trainer.shared_memory = (ring - 1).to_string();
        assert!(rejected(&q).contains("trainer.sharedMemory is too small"));
    }

    #[test]
    fn fixed_replicas_required_when_autoscaling_off() {
        let mut dp = qwen();
        dp.spec.autoscaling.replicas = None;
        assert!(rejected(&dp).contains("autoscaling.replicas is required"));
        dp.spec.autoscaling.replicas = Some(9);
        assert!(rejected(&dp).contains("must lie between decoders.minReplicas"));
    }

    #[test]
    fn fixed_replicas_only_when_autoscaling_off() {
        let mut dp = crop();
        dp.spec.autoscaling.replicas = Some(4);
        assert!(rejected(&dp).contains("applies only when autoscaling.mode is fixed"));
    }

    #[test]
    fn scale_steps_are_positive() {
        let mut dp = crop();
        dp.spec.autoscaling.max_scale_down_step = 0;
        assert!(rejected(&dp).contains("must be at least 1"));
    }

    #[test]
    fn batch_is_immutable() {
        let old = crop();
        let mut new = crop();
        new.spec.batch.size = 64;
        assert!(rejected_update(&new, &old).contains("batch is immutable"));
    }

    #[test]
    fn bucket_is_immutable() {
        let old = crop();
        let mut new = crop();
        new.spec.source.s3.bucket = "other-bucket".into();
        assert!(rejected_update(&new, &old).contains("source.s3.bucket is immutable"));
    }

    #[test]
    fn shared_memory_is_immutable() {
        let old = crop();
        let mut new = crop();
        new.spec.trainer.shared_memory = "4Gi".into();
        assert!(rejected_update(&new, &old).contains("trainer.sharedMemory is immutable"));
    }

    #[test]
    fn scaling_fields_stay_mutable() {
        let old = crop();
        let mut new = crop();
        new.spec.decoders.min_replicas = 10;
        new.validate_cel_update(&old).expect("scaling is allowed");
    }
}
