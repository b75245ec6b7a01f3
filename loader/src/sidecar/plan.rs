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
    pub batches: Vec<Vec<usize>>,
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
        let world = self.shard.world_size.max(1) as usize;
        let rank = self.shard.rank as usize;
        let bs = self.batch_size.max(1);
        let mut order: Vec<usize> = (0..samples).collect();
        if self.shuffle {
            shuffle(&mut order, mix(self.seed, epoch));
        }
        let per_rank = self.samples_per_rank(samples);
        // Padding (no drop_last): repeat the start so the list divides by the world size.
        let mine: Vec<usize> = (0..per_rank)
            .map(|k| order[(rank + k * world) % samples.max(1)])
            .filter(|_| samples > 0)
            .collect();
        EpochPlan {
            epoch,
            batches: mine.chunks(bs).map(<[usize]>::to_vec).collect(),
        }
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
