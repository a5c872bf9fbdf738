//! A rank's compute threads for work split by (batch, head): every item owns the
//! accumulators it writes and is computed the same way on any thread, so results are
//! bit-identical for any thread count ([`crate::RingOptions::threads`]).

use std::sync::{Mutex, PoisonError};

use attn_core::{AttnError, Result};

/// Run `work` on every item: on the calling thread alone when `threads <= 1`, else on
/// it and up to `threads - 1` scoped workers, each taking the next item in order.
/// The first error stops every thread at its next item and is returned.
pub(crate) fn for_each_item<I: Send>(
    threads: usize,
    items: Vec<I>,
    work: impl Fn(I) -> Result<()> + Sync,
) -> Result<()> {
    let workers = threads.min(items.len());
    if workers <= 1 {
        return items.into_iter().try_for_each(work);
    }
    let queue = Mutex::new(items.into_iter());
    let failed: Mutex<Option<AttnError>> = Mutex::new(None);
    let run = || {
        loop {
            if failed.lock().unwrap_or_else(PoisonError::into_inner).is_some() {
                break;
            }
            let Some(item) = queue.lock().unwrap_or_else(PoisonError::into_inner).next() else { break };
            if let Err(e) = work(item) {
                failed.lock().unwrap_or_else(PoisonError::into_inner).get_or_insert(e);
                break;
            }
        }
    };
    std::thread::scope(|scope| {
        for _ in 1..workers {
            scope.spawn(run);
        }
        run();
    });
    failed.into_inner().unwrap_or_else(PoisonError::into_inner).map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_item_runs_once_for_any_thread_count() {
        for threads in [0, 1, 2, 3, 64] {
            let mut acc = vec![0u64; 40];
            let items: Vec<(usize, &mut u64)> = acc.iter_mut().enumerate().collect();
            for_each_item(threads, items, |(i, slot)| {
                *slot += (i as u64 + 1) * 3;
                Ok(())
            })
            .unwrap();
            assert_eq!(acc, (1..=40u64).map(|i| i * 3).collect::<Vec<_>>(), "threads={threads}");
        }
    }

    #[test]
    fn an_error_stops_the_work_and_is_returned() {
        for threads in [1, 2, 4] {
            let ran = AtomicUsize::new(0);
            let items: Vec<usize> = (0..2000).collect();
            let res = for_each_item(threads, items, |i| {
                ran.fetch_add(1, Ordering::Relaxed);
                if i == 5 {
                    return Err(AttnError::InvalidArgument(format!("item {i}")));
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
                Ok(())
            });
            assert!(matches!(res, Err(AttnError::InvalidArgument(ref m)) if m == "item 5"), "{res:?}");
            // Each thread stops at its next item after the failure.
            assert!(ran.load(Ordering::Relaxed) < 2000, "threads={threads}");
        }
    }
}
