//! What a stream's plan orders: a sample list (a listed prefix or a manifest), or WebDataset
//! shards through their index.

use std::sync::Arc;

use super::plan::{Cursor, PlanConfig, ShardSample};
use crate::index::{IndexError, ShardTable};
use crate::source::{S3Source, SampleRef};

/// The dataset a sidecar plans over.
#[derive(Debug, Clone)]
pub enum Samples {
    /// One entry per sample, held in memory.
    Listed(Arc<Vec<SampleRef>>),
    /// Shards through their index: the plan holds O(shards) plus the shuffle window, and a
    /// batch's byte ranges are read from the index when the batch is decoded.
    Sharded {
        table: Arc<ShardTable>,
        total: usize,
        window: usize,
    },
}

/// A planned batch's samples, before their byte ranges are known.
#[derive(Debug, Clone)]
pub enum PlannedSamples {
    Refs(Vec<SampleRef>),
    Shard {
        table: Arc<ShardTable>,
        samples: Vec<ShardSample>,
    },
}

/// The batches of one epoch for one rank, from a cursor on.
pub struct EpochBatches<'a> {
    /// Index in the epoch of the first batch.
    pub first_index: u64,
    /// Each batch with the epoch's position once every rank has consumed it.
    pub batches: Box<dyn Iterator<Item = (PlannedSamples, usize)> + Send + 'a>,
}

impl Samples {
    pub fn sharded(table: ShardTable, window: usize) -> Self {
        let total = table.counts.iter().map(|&c| c as usize).sum();
        Samples::Sharded {
            table: Arc::new(table),
            total,
            window,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Samples::Listed(refs) => refs.len(),
            Samples::Sharded { total, .. } => *total,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bucket the decode requests name: the shards' for an index, else `listed`.
    pub fn bucket<'a>(&'a self, listed: &'a str) -> &'a str {
        match self {
            Samples::Listed(_) => listed,
            Samples::Sharded { table, .. } => &table.bucket,
        }
    }

    /// The rest of `from.epoch` for `plan`'s rank. A listed plan is built whole (O(samples
    /// per rank)); a sharded one streams.
    pub fn batches_from(&self, plan: &PlanConfig, from: Cursor) -> EpochBatches<'_> {
        let first_index = plan.first_batch_index(from, self.len());
        match self {
            Samples::Listed(refs) => {
                let epoch = plan.plan_from(refs.len(), from);
                let batches =
                    epoch
                        .batches
                        .into_iter()
                        .zip(epoch.positions)
                        .map(move |(batch, position)| {
                            let batch = batch.iter().map(|&i| refs[i].clone()).collect();
                            (PlannedSamples::Refs(batch), position)
                        });
                EpochBatches {
                    first_index,
                    batches: Box::new(batches),
                }
            }
            Samples::Sharded { table, window, .. } => {
                let batches = plan.shard_plan_from(&table.counts, *window, from).map(|b| {
                    let planned = PlannedSamples::Shard {
                        table: table.clone(),
                        samples: b.samples,
                    };
                    (planned, b.position)
                });
                EpochBatches {
                    first_index,
                    batches: Box::new(batches),
                }
            }
        }
    }
}

impl PlannedSamples {
    /// The decode requests' samples: for shards, one range read of the index per shard in
    /// the batch.
    pub async fn resolve(self, source: &S3Source) -> Result<Vec<SampleRef>, IndexError> {
        match self {
            PlannedSamples::Refs(refs) => Ok(refs),
            PlannedSamples::Shard { table, samples } => table.sample_refs(source, &samples).await,
        }
    }
}
