//! `ShmRing`: a ring of fixed-size slots in one file of a memory-backed directory (/dev/shm,
//! or the pod's `emptyDir: {medium: Memory}`), mapped by the sidecar and by the trainer.
//!
//! The number of slots bounds the memory of the whole hand-off: a batch is requested only once
//! a slot is free, so a trainer that stops consuming stops the sidecar from requesting.
//! Ownership of a slot moves sidecar (a [`SlotLease`] while it is being filled) → trainer (after
//! delivery, by index) → free (when the trainer releases it), so no two parties ever write the
//! same slot.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use memmap2::{MmapOptions, MmapRaw};
use tokio::sync::Semaphore;

/// Slots start on page boundaries so that the trainer can register the mapping with CUDA and
/// every slot is page-aligned for DMA.
const PAGE: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum RingError {
    #[error("creating ring file {path}: {source}")]
    Create {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("mapping ring file {path}: {source}")]
    Map {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("a ring needs at least one slot of at least one byte ({slots} x {slot_bytes})")]
    Empty { slots: usize, slot_bytes: usize },
    #[error("slot {slot} is not held by the trainer")]
    NotHeld { slot: u32 },
}

impl RingError {
    pub fn category(&self) -> &'static str {
        match self {
            RingError::Create { .. } => "ring_create",
            RingError::Map { .. } => "ring_map",
            RingError::Empty { .. } => "ring_empty",
            RingError::NotHeld { .. } => "slot_not_held",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Free,
    Filling,
    Held,
}

/// Mode of the ring file and the trainer sockets: the sidecar's user and the pod's group (the
/// fsGroup the webhook sets, which every container of the pod has), never other users.
pub const SHARED_MODE: u32 = 0o660;

pub struct ShmRing {
    path: PathBuf,
    map: MmapRaw,
    slots: usize,
    slot_bytes: usize,
    states: Mutex<Vec<SlotState>>,
    free: Semaphore,
}

impl std::fmt::Debug for ShmRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmRing")
            .field("path", &self.path)
            .field("slots", &self.slots)
            .field("slot_bytes", &self.slot_bytes)
            .finish()
    }
}

impl ShmRing {
    /// Creates `dir/stoker-ring-<pid>-<local rank>.bin` with `slots` slots of at least
    /// `slot_bytes` bytes.
    pub fn create(
        dir: &Path,
        local_rank: u32,
        slots: usize,
        slot_bytes: usize,
    ) -> Result<Arc<ShmRing>, RingError> {
        if slots == 0 || slot_bytes == 0 {
            return Err(RingError::Empty { slots, slot_bytes });
        }
        let slot_bytes = slot_bytes.div_ceil(PAGE) * PAGE;
        let path = dir.join(format!(
            "stoker-ring-{}-{local_rank}.bin",
            std::process::id()
        ));
        let create_err = |source| RingError::Create {
            path: path.clone(),
            source,
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .map_err(create_err)?;
        // Whatever the umask: the trainer reads the ring through the group it shares with us.
        file.set_permissions(std::fs::Permissions::from_mode(SHARED_MODE))
            .map_err(create_err)?;
        // Sparse: pages of tmpfs are allocated when a batch is first written into them.
        file.set_len((slots * slot_bytes) as u64)
            .map_err(create_err)?;
        let map = MmapOptions::new()
            .map_raw(&file)
            .map_err(|source| RingError::Map {
                path: path.clone(),
                source,
            })?;
        Ok(Arc::new(ShmRing {
            path,
            map,
            slots,
            slot_bytes,
            states: Mutex::new(vec![SlotState::Free; slots]),
            free: Semaphore::new(slots),
        }))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn slots(&self) -> usize {
        self.slots
    }

    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    pub fn free_slots(&self) -> usize {
        self.free.available_permits()
    }

    /// Waits for a free slot: this wait is the sidecar's backpressure.
    pub async fn acquire(self: &Arc<Self>) -> SlotLease {
        // The semaphore is never closed, so acquire cannot fail; fall back to waiting forever.
        match self.free.acquire().await {
            Ok(permit) => permit.forget(),
            Err(_) => std::future::pending::<()>().await,
        }
        let mut states = self.lock();
        let index = states
            .iter()
            .position(|s| *s == SlotState::Free)
            .unwrap_or(0);
        states[index] = SlotState::Filling;
        SlotLease {
            ring: self.clone(),
            index: index as u32,
            published: false,
        }
    }

    /// The trainer is done with `slot`.
    pub fn release(&self, slot: u32) -> Result<(), RingError> {
        let mut states = self.lock();
        match states.get_mut(slot as usize) {
            Some(s) if *s == SlotState::Held => {
                *s = SlotState::Free;
                drop(states);
                self.free.add_permits(1);
                Ok(())
            }
            _ => Err(RingError::NotHeld { slot }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<SlotState>> {
        // A poisoned lock only means another thread panicked mid-update of a plain Vec; the
        // states are still consistent enough to keep serving.
        self.states
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Drop for ShmRing {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Write access to one slot while the sidecar fills it. Dropped without [`SlotLease::publish`]
/// (a failed batch), the slot goes back to the free list.
pub struct SlotLease {
    ring: Arc<ShmRing>,
    index: u32,
    published: bool,
}

impl SlotLease {
    pub fn index(&self) -> u32 {
        self.index
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let len = self.ring.slot_bytes;
        // SAFETY: the mapping is `slots * slot_bytes` long and lives as long as `ring`; the slot
        // is in state Filling, which only this lease can be in, so this is the only reference
        // to these bytes in this process, and the trainer reads a slot only after delivery.
        unsafe {
            let start = self.ring.map.as_mut_ptr().add(self.index as usize * len);
            std::slice::from_raw_parts_mut(start, len)
        }
    }

    /// Hands the slot to the trainer; it comes back through [`ShmRing::release`].
    pub fn publish(mut self) -> u32 {
        self.ring.lock()[self.index as usize] = SlotState::Held;
        self.published = true;
        self.index
    }
}

impl Drop for SlotLease {
    fn drop(&mut self) {
        if !self.published {
            self.ring.lock()[self.index as usize] = SlotState::Free;
            self.ring.free.add_permits(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn slots_cycle_and_bound_the_ring() {
        let dir = tempfile::tempdir().unwrap();
        let ring = ShmRing::create(dir.path(), 0, 2, 100).unwrap();
        assert_eq!(ring.slot_bytes(), PAGE);
        let mut a = ring.acquire().await;
        a.bytes_mut()[0] = 7;
        let b = ring.acquire().await;
        assert_ne!(a.index(), b.index());
        assert_eq!(ring.free_slots(), 0);
        // A third acquire waits until a slot comes back.
        let waiting =
            tokio::time::timeout(std::time::Duration::from_millis(50), ring.acquire()).await;
        assert!(waiting.is_err());
        drop(b);
        let c = ring.acquire().await;
        let held = a.publish();
        assert!(
            ring.release(c.index()).is_err(),
            "a slot being filled cannot be released"
        );
        ring.release(held).unwrap();
        assert!(ring.release(held).is_err(), "double release is refused");
        let data = std::fs::read(ring.path()).unwrap();
        assert_eq!(
            data[held as usize * PAGE],
            7,
            "writes land in the shared file"
        );
    }
}
