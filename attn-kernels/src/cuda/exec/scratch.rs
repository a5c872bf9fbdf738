//! Scratch a whole call reuses from one call to the next: the f32 gradient accumulators,
//! `delta`, the forward's f32 partial and the persistent forward's work counter, kept per stream in a [`ScratchPool`] and handed
//! out again while the shape repeats, so a training loop allocates device memory on its
//! first step only. The pool is generic over the allocator, so the CPU emulation counts
//! its allocations with the same code the device runs.

use attn_core::{AttnError, Result, Shape4};

use crate::cuda::plan::launch_plan::DirectGrads;

/// A buffer of f32 values a pool can hold: its length.
pub trait ScratchBuffer {
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl ScratchBuffer for Vec<f32> {
    fn len(&self) -> usize {
        Vec::len(self)
    }
}

/// What a pool's buffers are made by: the device's stream, or host memory for the emulation.
pub trait ScratchAlloc {
    type Buffer: ScratchBuffer;

    /// A new buffer of `len` values, zeroed (the work counter relies on it; the other slots'
    /// users fill what they read).
    fn alloc_f32(&self, len: usize) -> Result<Self::Buffer>;
}

/// Host memory standing in for the device's in the emulation.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostMemory;

impl ScratchAlloc for HostMemory {
    type Buffer = Vec<f32>;

    fn alloc_f32(&self, len: usize) -> Result<Vec<f32>> {
        let mut v = Vec::new();
        v.try_reserve_exact(len)
            .map_err(|_| AttnError::InvalidArgument(format!("cannot allocate {len} f32 scratch values")))?;
        v.resize(len, 0.0);
        Ok(v)
    }
}

/// The scratch buffers of a whole call, each a slot of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScratchSlot {
    /// `dot(grad_out, out) - grad_lse` per query row.
    Delta,
    /// The f32 accumulators of dq, dk and dv.
    GradQuery,
    GradKey,
    GradValue,
    /// The forward's f32 partial output, where the output is not written straight from
    /// the kernel (its lse is the caller's).
    PartialOut,
    /// The persistent forward's work counter ([`WORK_COUNTER_LEN`] u32 in f32 slots): zero
    /// when allocated, and zero again after every launch (its last block resets it), so it
    /// is never filled in the steady state.
    WorkCounter,
}

/// Values of the [`ScratchSlot::WorkCounter`] slot: the next work item and the blocks done.
pub const WORK_COUNTER_LEN: usize = 2;

impl ScratchSlot {
    const COUNT: usize = 6;

    fn index(self) -> usize {
        self as usize
    }
}

/// The lengths of a backward's slots for queries of `q` and keys of `kv`:
/// `[(slot, len)]` for delta, dq, dk, dv.
pub fn backward_scratch(q: Shape4, kv: Shape4) -> [(ScratchSlot, usize); 4] {
    [
        (ScratchSlot::Delta, q.lse_len()),
        (ScratchSlot::GradQuery, q.numel()),
        (ScratchSlot::GradKey, kv.numel()),
        (ScratchSlot::GradValue, kv.numel()),
    ]
}

/// The slots a whole call's backward takes, of [`backward_scratch`]'s: delta, and an
/// accumulator for each gradient the kernels do not write directly (`direct`).
pub fn backward_slots(q: Shape4, kv: Shape4, direct: Option<DirectGrads>) -> [Option<(ScratchSlot, usize)>; 4] {
    let [delta, dq, dk, dv] = backward_scratch(q, kv);
    let dq_direct = direct.is_some_and(DirectGrads::dq);
    let dkv_direct = direct.is_some_and(DirectGrads::dkv);
    [Some(delta), (!dq_direct).then_some(dq), (!dkv_direct).then_some(dk), (!dkv_direct).then_some(dv)]
}

/// Buffers kept between calls, one per [`ScratchSlot`]: [`take`](Self::take) hands out the
/// slot's buffer when it has the length asked for and allocates (and counts) one otherwise;
/// [`give`](Self::give) keeps it for the next call. A call that fails before giving a buffer
/// back only costs the next call an allocation.
#[derive(Debug)]
pub struct ScratchPool<B> {
    slots: [Option<B>; ScratchSlot::COUNT],
    allocations: u64,
}

impl<B> Default for ScratchPool<B> {
    fn default() -> Self {
        ScratchPool { slots: std::array::from_fn(|_| None), allocations: 0 }
    }
}

impl<B: ScratchBuffer> ScratchPool<B> {
    /// The buffer of `slot` with `len` values: the kept one where its length is `len`, else
    /// a new one from `alloc` (the kept one, of another length, is dropped).
    pub fn take<A: ScratchAlloc<Buffer = B>>(&mut self, alloc: &A, slot: ScratchSlot, len: usize) -> Result<B> {
        match self.slots[slot.index()].take() {
            Some(b) if b.len() == len => Ok(b),
            _ => {
                self.allocations += 1;
                alloc.alloc_f32(len)
            }
        }
    }

    /// Keep `buffer` in `slot` for the next call.
    pub fn give(&mut self, slot: ScratchSlot, buffer: B) {
        self.slots[slot.index()] = Some(buffer);
    }

    /// Buffers allocated so far.
    pub fn allocations(&self) -> u64 {
        self.allocations
    }

    /// Bytes the kept buffers hold.
    pub fn kept_bytes(&self) -> usize {
        self.slots.iter().flatten().map(|b| 4 * b.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeated_length_reuses_the_kept_buffer_and_another_allocates() {
        let mut pool = ScratchPool::<Vec<f32>>::default();
        for _ in 0..3 {
            let b = pool.take(&HostMemory, ScratchSlot::GradQuery, 10).unwrap();
            assert_eq!(b.len(), 10);
            pool.give(ScratchSlot::GradQuery, b);
        }
        assert_eq!(pool.allocations(), 1);
        // Another slot, then another length in the first slot: one allocation each.
        let d = pool.take(&HostMemory, ScratchSlot::Delta, 10).unwrap();
        pool.give(ScratchSlot::Delta, d);
        let b = pool.take(&HostMemory, ScratchSlot::GradQuery, 12).unwrap();
        assert_eq!((b.len(), pool.allocations()), (12, 3));
        pool.give(ScratchSlot::GradQuery, b);
        assert_eq!(pool.kept_bytes(), 4 * (10 + 12));
    }

    #[test]
    fn a_buffer_not_given_back_is_allocated_again() {
        let mut pool = ScratchPool::<Vec<f32>>::default();
        let _lost = pool.take(&HostMemory, ScratchSlot::GradKey, 4).unwrap();
        let b = pool.take(&HostMemory, ScratchSlot::GradKey, 4).unwrap();
        pool.give(ScratchSlot::GradKey, b);
        assert_eq!(pool.allocations(), 2);
    }

    #[test]
    fn backward_slots_cover_delta_and_the_three_accumulators() {
        let (q, kv) = (Shape4::new(2, 5, 4, 8).unwrap(), Shape4::new(2, 7, 2, 8).unwrap());
        let lens = backward_scratch(q, kv).map(|(_, n)| n);
        assert_eq!(lens, [2 * 5 * 4, 2 * 5 * 4 * 8, 2 * 7 * 2 * 8, 2 * 7 * 2 * 8]);
    }
}
