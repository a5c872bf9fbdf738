//! A watchdog: run work on its own thread and give up waiting after a deadline, so a
//! hang is a test failure with a message instead of a stuck CI job.

use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The work did not finish within the deadline (its thread is left running, detached).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hung {
    pub after: Duration,
}

/// Run `f` on a new thread and wait at most `limit` for it. A panic inside `f` is
/// re-raised on the caller's thread.
pub fn within<R: Send + 'static>(limit: Duration, f: impl FnOnce() -> R + Send + 'static) -> Result<R, Hung> {
    let (tx, rx) = mpsc::channel();
    let start = Instant::now();
    let handle = std::thread::Builder::new()
        .name("watched".into())
        .spawn(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
            let _ = tx.send(r);
        })
        .map_err(|_| Hung { after: Duration::ZERO })?;
    match rx.recv_timeout(limit) {
        Ok(Ok(r)) => {
            let _ = handle.join();
            Ok(r)
        }
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => Err(Hung { after: start.elapsed() }),
    }
}
