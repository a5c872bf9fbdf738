//! Large output buffers backed by transparent huge pages: [`zeroed_buffer`] asks the
//! kernel (Linux `madvise(MADV_HUGEPAGE)`) to fault a fresh buffer in 2 MiB at a time,
//! so the first writes of a 100 MB output cost dozens of page faults, not tens of
//! thousands. Elsewhere, or when the kernel declines, it is a plain zeroed `Vec`.
#![allow(unsafe_code)]

use attn_core::{AttnError, Result};

/// Buffers below this many bytes are left to the allocator as they are.
const MIN_ADVISED_BYTES: usize = 4 << 20;

/// Transparent huge page size on x86-64 Linux.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
const HUGE_PAGE: usize = 2 << 20;

/// `n` copies of `T::default()` (zero for the float types) in a fresh allocation;
/// from 4 MiB on, the whole 2 MiB pages inside it are advised as huge
/// pages before anything touches them. Meant for outputs and gradients that a call
/// then overwrites: `CpuBackend::forward_vec` allocates with it, and callers who
/// bring their own buffers can too. A size the allocator refuses is
/// `AttnError::OverBudget`, not an abort.
pub fn zeroed_buffer<T: Copy + Default>(n: usize) -> Result<Vec<T>> {
    let bytes = n.saturating_mul(std::mem::size_of::<T>());
    let mut v = Vec::<T>::new();
    v.try_reserve_exact(n).map_err(|_| AttnError::OverBudget { needed: bytes, budget: isize::MAX as usize })?;
    if bytes >= MIN_ADVISED_BYTES {
        advise_huge(v.as_mut_ptr().cast::<u8>() as usize, bytes);
    }
    v.resize(n, T::default());
    Ok(v)
}

/// Advise the whole huge pages of `[addr, addr + len)` (a range this process owns).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn advise_huge(addr: usize, len: usize) {
    let start = addr.next_multiple_of(HUGE_PAGE);
    let end = (addr + len) / HUGE_PAGE * HUGE_PAGE;
    if end > start {
        // SAFETY: `[start, end)` lies inside the caller's live allocation of `len`
        // bytes at `addr` (rounded inwards to whole pages); MADV_HUGEPAGE only changes
        // how future faults in that range are served, never its contents or mapping.
        // A failure (no THP support) leaves ordinary pages, which is fine to ignore.
        let _ = unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn advise_huge(_addr: usize, _len: usize) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_zeroed_at_every_size() {
        for n in [0, 1, 1000, (MIN_ADVISED_BYTES / 4) + 3, 3 * (MIN_ADVISED_BYTES / 4)] {
            let f: Vec<f32> = zeroed_buffer(n).unwrap();
            assert_eq!(f.len(), n);
            assert!(f.iter().all(|x| x.to_bits() == 0));
            let h: Vec<half::bf16> = zeroed_buffer(n).unwrap();
            assert!(h.len() == n && h.iter().all(|x| x.to_bits() == 0));
        }
    }

    #[test]
    fn impossible_sizes_are_typed_errors() {
        for n in [usize::MAX / 4, usize::MAX / 8 + 1, 1 << 60] {
            match zeroed_buffer::<f32>(n) {
                Err(AttnError::OverBudget { needed, .. }) => assert!(needed >= n),
                other => panic!("n = {n}: {:?}", other.map(|v| v.len())),
            }
        }
    }
}
