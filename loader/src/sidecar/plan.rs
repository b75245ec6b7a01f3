//! The epoch plan, pure: which samples form which batch, for one rank, in which order.
//!
//! The order is a function of (seed, epoch, rank, world size) and the dataset's sample list
//! only, so a restarted sidecar resumes a checkpointed job with the identical order. The
//! shuffle is our own (SplitMix64 + Fisher–Yates) rather than a crate's, so that a dependency
//! upgrade can never change the order of a job in flight.
//!
//! Sharding follows PyTorch's `DistributedSampler`: the shuffled list is dealt round-robin to
//! ranks. Every rank gets the same number of batches, because a rank that runs out early
//! hangs the others in their next collective:
//! - `drop_last`: each rank takes `floor(n / world / batch) * batch` samples; the tail is
//!   dropped and every batch is full. Shards are disjoint.
//! - otherwise: the list is padded by repeating its start until it divides by the world size
//!   (at most `world - 1` repeats, as `DistributedSampler` does); every sample is delivered,
//!   and the last batch of each rank may be short.
//!
//! Resuming and elastic world sizes rest on one property of that deal: once every rank has
//! consumed `c` samples of an epoch, the samples consumed are exactly the first `c × world`
//! of the epoch's shuffled order. So a resume point is one number per epoch, the *position*
//! (samples of the order consumed by all ranks together), and a plan can start from any
//! position: the rest of the order is dealt the same way over the ranks there are now. With an
//! unchanged world size this is the plan skipping its first batches; with a new one, every
//! remaining sample is still delivered once (plus the padding above, without `drop_last`).

/// Where a rank sits in the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub rank: u32,
    pub world_size: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanConfig {
    pub seed: u64,
    pub batch_size: usize,
    pub drop_last: bool,
    /// false keeps the dataset order (evaluation).
    pub shuffle: bool,
    pub shard: Shard,
}

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("rank {rank} is not below world size {world_size}")]
    RankOutOfRange { rank: u32, world_size: u32 },
    #[error("batch size must be at least 1")]
    ZeroBatch,
    #[error(
        "{samples} samples give rank {rank} of {world_size} no batch of {batch_size} (dropLast)"
    )]
    NoBatches {
        samples: usize,
        rank: u32,
        world_size: u32,
        batch_size: usize,
    },
}

impl PlanError {
    pub fn category(&self) -> &'static str {
        match self {
            PlanError::RankOutOfRange { .. } => "rank_out_of_range",
            PlanError::ZeroBatch => "zero_batch",
            PlanError::NoBatches { .. } => "no_batches",
        }
    }
}

/// The batches of one epoch for one rank: indices into the dataset's sample list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EpochPlan {
    pub epoch: u64,
    /// Index in the epoch of the first batch (non-zero when the plan starts mid-epoch).
    pub first_index: u64,
    pub batches: Vec<Vec<usize>>,
    /// For each batch, the epoch's position once every rank has consumed it: what a
    /// checkpoint taken after that batch resumes from.
    pub positions: Vec<usize>,
}

/// Where a stream stands: the next sample of `epoch`'s order to deliver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Cursor {
    pub epoch: u64,
    /// Samples of the epoch's shuffled order already consumed by all ranks together.
    pub position: usize,
}

impl PlanConfig {
    pub fn validate(&self, samples: usize) -> Result<(), PlanError> {
        let Shard { rank, world_size } = self.shard;
        if world_size == 0 || rank >= world_size {
            return Err(PlanError::RankOutOfRange { rank, world_size });
        }
        if self.batch_size == 0 {
            return Err(PlanError::ZeroBatch);
        }
        if self.batches_per_epoch(samples) == 0 {
            return Err(PlanError::NoBatches {
                samples,
                rank,
                world_size,
                batch_size: self.batch_size,
            });
        }
        Ok(())
    }

    /// Samples each rank receives per epoch (equal on every rank).
    pub fn samples_per_rank(&self, samples: usize) -> usize {
        let world = self.shard.world_size.max(1) as usize;
        if self.drop_last {
            (samples / world / self.batch_size.max(1)) * self.batch_size.max(1)
        } else {
            samples.div_ceil(world)
        }
    }

    /// Batches each rank receives per epoch (equal on every rank).
    pub fn batches_per_epoch(&self, samples: usize) -> usize {
        self.samples_per_rank(samples)
            .div_ceil(self.batch_size.max(1))
    }

    /// The plan of `epoch` for this rank over a dataset of `samples` samples.
    pub fn epoch(&self, samples: usize, epoch: u64) -> EpochPlan {
        self.plan_from(samples, Cursor { epoch, position: 0 })
    }

    /// The plan of the rest of `from.epoch` for this rank: the samples of the epoch's order
    /// from `from.position` on, dealt over the current world size.
    pub fn plan_from(&self, samples: usize, from: Cursor) -> EpochPlan {
        let world = self.shard.world_size.max(1) as usize;
        let rank = self.shard.rank as usize;
        let bs = self.batch_size.max(1);
        let mut order: Vec<usize> = (0..samples).collect();
        if self.shuffle {
            shuffle(&mut order, mix(self.seed, from.epoch));
        }
        let start = from.position.min(samples);
        let rest = samples - start;
        let per_rank = self.samples_per_rank(rest);
        // Padding (no drop_last): repeat the epoch's first samples so the rest divides by the
        // world size (the same repeats whether or not the plan resumed at this world size).
        let mine: Vec<usize> = (0..per_rank)
            .map(|k| order[(start + rank + k * world) % samples])
            .collect();
        let batches: Vec<Vec<usize>> = mine.chunks(bs).map(<[usize]>::to_vec).collect();
        let positions = (1..=batches.len())
            .map(|j| start + (j * bs * world).min(rest))
            .collect();
        EpochPlan {
            epoch: from.epoch,
            first_index: (start / (bs * world)) as u64,
            batches,
            positions,
        }
    }

    /// The position after the first `batches` batches of an epoch, at this world size.
    pub fn position_after(&self, samples: usize, batches: u64) -> usize {
        let step = self.batch_size.max(1) * self.shard.world_size.max(1) as usize;
        (batches as usize).saturating_mul(step).min(samples)
    }
}

/// One 64-bit seed per (seed, epoch), so epochs are independent shuffles.
fn mix(seed: u64, epoch: u64) -> u64 {
    let mut s = SplitMix64(seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    s.next_u64()
}

struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in 0..n (Lemire's multiply-shift; the tiny bias is irrelevant for shuffling).
    fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }
}

fn shuffle(v: &mut [usize], seed: u64) {
    let mut rng = SplitMix64(seed);
    for i in (1..v.len()).rev() {
        let j = rng.below(i + 1);
        v.swap(i, j);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn cfg(rank: u32, world_size: u32, batch_size: usize, drop_last: bool) -> PlanConfig {
        PlanConfig {
            seed: 42,
            batch_size,
            drop_last,
            shuffle: true,
            shard: Shard { rank, world_size },
        }
    }

    #[test]
    fn ranks_are_disjoint_cover_everything_and_have_equal_batch_counts() {
        for (n, world, bs) in [
            (100, 4, 8),
            (101, 4, 8),
            (7, 2, 3),
            (64, 1, 16),
            (1000, 8, 32),
        ] {
            let plans: Vec<EpochPlan> = (0..world)
                .map(|r| cfg(r, world, bs, false).epoch(n, 3))
                .collect();
            let counts: HashSet<usize> = plans.iter().map(|p| p.batches.len()).collect();
            assert_eq!(
                counts.len(),
                1,
                "n={n} world={world}: batch counts {counts:?}"
            );
            let all: Vec<usize> = plans
                .iter()
                .flat_map(|p| p.batches.iter().flatten().copied())
                .collect();
            let distinct: HashSet<usize> = all.iter().copied().collect();
            assert_eq!(distinct.len(), n, "every sample delivered");
            assert!(
                all.len() - n < world as usize,
                "padding is below the world size"
            );
            if n % world as usize == 0 {
                assert_eq!(all.len(), n, "no padding when n divides by the world size");
            }
        }
    }

    #[test]
    fn drop_last_gives_full_batches_and_disjoint_shards() {
        let (n, world, bs) = (103, 4, 8);
        let plans: Vec<EpochPlan> = (0..world)
            .map(|r| cfg(r, world, bs, true).epoch(n, 0))
            .collect();
        let mut seen = HashSet::new();
        for p in &plans {
            assert_eq!(p.batches.len(), 3);
            for b in &p.batches {
                assert_eq!(b.len(), bs);
                for i in b {
                    assert!(seen.insert(*i), "sample {i} on two ranks");
                }
            }
        }
    }

    #[test]
    fn order_is_deterministic_per_epoch_and_differs_across_epochs() {
        let c = cfg(1, 2, 4, false);
        assert_eq!(c.epoch(50, 7), c.epoch(50, 7));
        assert_ne!(c.epoch(50, 7).batches, c.epoch(50, 8).batches);
        let unshuffled = PlanConfig {
            shuffle: false,
            ..c
        }
        .epoch(8, 0);
        assert_eq!(unshuffled.batches, vec![vec![1, 3, 5, 7]]);
    }

    #[test]
    fn the_shuffle_is_pinned() {
        // Changing this order breaks the resumption of running jobs: update it only on purpose.
        let p = cfg(0, 1, 10, false).epoch(10, 0);
        assert_eq!(p.batches[0], vec![1, 7, 2, 5, 6, 4, 0, 9, 8, 3]);
    }

    /// The epoch's shuffled order, as one rank of a world of one sees it.
    fn order(n: usize, epoch: u64) -> Vec<usize> {
        cfg(0, 1, n, false).epoch(n, epoch).batches.concat()
    }

    /// Samples each rank delivers from `from` to the end of the epoch, with `world` ranks.
    fn deliveries(n: usize, world: u32, bs: usize, drop_last: bool, from: Cursor) -> Vec<usize> {
        (0..world)
            .flat_map(|r| cfg(r, world, bs, drop_last).plan_from(n, from).batches)
            .flatten()
            .collect()
    }

    #[test]
    fn a_resume_at_the_same_world_size_skips_exactly_the_consumed_batches() {
        let (n, world, bs) = (101, 4, 5);
        for rank in 0..world {
            let c = cfg(rank, world, bs, false);
            let full = c.epoch(n, 2);
            for k in 0..full.batches.len() {
                let position = if k == 0 { 0 } else { full.positions[k - 1] };
                let from = Cursor { epoch: 2, position };
                let resumed = c.plan_from(n, from);
                assert_eq!(resumed.batches, full.batches[k..], "rank {rank} after {k}");
                assert_eq!(resumed.first_index, k as u64);
                assert_eq!(resumed.positions, full.positions[k..]);
            }
        }
    }

    #[test]
    fn a_new_world_size_delivers_the_rest_of_the_epoch_exactly_once() {
        // 144 samples, batch 4, 4 ranks: 3 batches each are 48 samples; 96 remain for 3 ranks.
        let (n, bs) = (144, 4);
        let before: Vec<usize> = (0..4)
            .flat_map(|r| cfg(r, 4, bs, false).epoch(n, 0).batches[..3].concat())
            .collect();
        let position = cfg(0, 4, bs, false).epoch(n, 0).positions[2];
        assert_eq!(position, 48);
        let after = deliveries(n, 3, bs, false, Cursor { epoch: 0, position });
        let mut all: Vec<usize> = before.iter().chain(&after).copied().collect();
        all.sort_unstable();
        assert_eq!(
            all,
            (0..n).collect::<Vec<_>>(),
            "every sample once over the epoch"
        );
        let counts: HashSet<usize> = (0..3)
            .map(|r| {
                cfg(r, 3, bs, false)
                    .plan_from(n, Cursor { epoch: 0, position })
                    .batches
                    .len()
            })
            .collect();
        assert_eq!(counts.len(), 1, "equal batch counts on the new ranks");
    }

    #[test]
    fn a_remainder_that_does_not_divide_is_padded_below_the_world_size() {
        let (n, bs) = (100, 4);
        let from = Cursor {
            epoch: 1,
            position: 32,
        };
        let after = deliveries(n, 3, bs, false, from);
        let rest: HashSet<usize> = order(n, 1)[32..].iter().copied().collect();
        let delivered: HashSet<usize> = after.iter().copied().collect();
        assert!(delivered.is_superset(&rest), "every remaining sample");
        assert!(after.len() - rest.len() < 3, "padding below the world size");
        let dropped = deliveries(n, 3, bs, true, from);
        let distinct: HashSet<usize> = dropped.iter().copied().collect();
        assert_eq!(distinct.len(), dropped.len(), "drop_last never repeats");
    }

    #[test]
    fn a_resume_at_the_end_of_an_epoch_has_no_batches() {
        let c = cfg(1, 2, 4, false);
        let plan = c.plan_from(
            10,
            Cursor {
                epoch: 0,
                position: 10,
            },
        );
        assert!(plan.batches.is_empty());
        assert_eq!(c.position_after(10, 2), 10);
    }

    #[test]
    fn bad_configs_are_errors() {
        assert!(matches!(
            cfg(2, 2, 4, false).validate(10),
            Err(PlanError::RankOutOfRange { .. })
        ));
        assert!(matches!(
            cfg(0, 1, 0, false).validate(10),
            Err(PlanError::ZeroBatch)
        ));
        assert!(matches!(
            cfg(0, 4, 8, true).validate(20),
            Err(PlanError::NoBatches { .. })
        ));
        assert!(cfg(0, 4, 8, false).validate(20).is_ok());
    }
}
