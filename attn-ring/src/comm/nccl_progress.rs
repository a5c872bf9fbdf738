//! `await_progress`: how an NCCL rank waits for a step of a non-blocking communicator
//! (its creation, the launch of a grouped round, the round's completion on the
//! stream): poll until the step is done, and abort the communicator when the step
//! fails or the deadline passes, so a dead or stalled peer becomes a typed error on
//! every waiting rank instead of a hang. Free of cudarc, so the policy is tested on
//! machines without a GPU; `nccl_handle` supplies the real polls and abort.
#![cfg_attr(not(feature = "nccl"), allow(dead_code))]

use std::time::{Duration, Instant};

use attn_core::{AttnError, Result};

/// What one poll of a pending step says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Progress {
    /// The step finished.
    Done,
    /// Still running (NCCL's `ncclInProgress`, or an event not yet reached).
    Pending,
    /// The step failed; the text says how.
    Failed(String),
}

/// Longest sleep between two polls.
const MAX_PAUSE: Duration = Duration::from_micros(200);

/// Poll `poll` until it says `Done`. When it says `Failed`, or still says `Pending`
/// once `deadline` has passed, call `abort` (exactly once) and return `Comm`, or
/// `Timeout` naming `rank`, `peer` and `timeout` (the budget `deadline` was set from).
/// `poll` is called at least once, even when the deadline has already passed.
pub(crate) fn await_progress(
    rank: usize,
    peer: usize,
    timeout: Duration,
    deadline: Instant,
    mut poll: impl FnMut() -> Progress,
    abort: impl FnOnce(),
) -> Result<()> {
    let mut pause = Duration::from_micros(5);
    loop {
        match poll() {
            Progress::Done => return Ok(()),
            Progress::Failed(message) => {
                abort();
                return Err(AttnError::Comm { rank, message });
            }
            Progress::Pending if Instant::now() >= deadline => {
                abort();
                let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
                return Err(AttnError::Timeout { rank, peer, timeout_ms });
            }
            Progress::Pending => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(MAX_PAUSE);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    fn run(polls: Vec<Progress>, timeout: Duration) -> (Result<()>, usize, usize) {
        let calls = Cell::new(0usize);
        let aborts = Cell::new(0usize);
        let mut script = polls.into_iter();
        let got = await_progress(
            3,
            1,
            timeout,
            Instant::now() + timeout,
            || {
                calls.set(calls.get() + 1);
                script.next().unwrap_or(Progress::Pending)
            },
            || aborts.set(aborts.get() + 1),
        );
        (got, calls.get(), aborts.get())
    }

    #[test]
    fn a_step_that_finishes_is_not_aborted() {
        let (got, calls, aborts) = run(vec![Progress::Done], Duration::from_secs(5));
        assert!(got.is_ok());
        assert_eq!((calls, aborts), (1, 0));
        let (got, calls, aborts) =
            run(vec![Progress::Pending, Progress::Pending, Progress::Done], Duration::from_secs(5));
        assert!(got.is_ok());
        assert_eq!((calls, aborts), (3, 0));
    }

    #[test]
    fn a_failed_step_aborts_once_and_says_why() {
        let (got, calls, aborts) =
            run(vec![Progress::Pending, Progress::Failed("ncclRemoteError".into())], Duration::from_secs(5));
        match got {
            Err(AttnError::Comm { rank: 3, message }) => assert_eq!(message, "ncclRemoteError"),
            other => panic!("expected a Comm error, got {other:?}"),
        }
        assert_eq!((calls, aborts), (2, 1));
    }

    #[test]
    fn a_stalled_step_times_out_and_aborts_once() {
        let timeout = Duration::from_millis(60);
        let start = Instant::now();
        let (got, calls, aborts) = run(vec![], timeout);
        let waited = start.elapsed();
        assert!(
            matches!(got, Err(AttnError::Timeout { rank: 3, peer: 1, timeout_ms: 60 })),
            "expected a Timeout, got {got:?}"
        );
        assert_eq!(aborts, 1);
        assert!(calls > 1, "polled {calls} times");
        assert!(waited >= timeout, "gave up after {waited:?}");
        assert!(waited < timeout + Duration::from_secs(2), "gave up only after {waited:?}");
    }

    #[test]
    fn a_passed_deadline_still_polls_once() {
        let (got, calls, aborts) = run(vec![Progress::Done], Duration::ZERO);
        assert!(got.is_ok());
        assert_eq!((calls, aborts), (1, 0));
        let (got, calls, aborts) = run(vec![], Duration::ZERO);
        assert!(matches!(got, Err(AttnError::Timeout { .. })));
        assert_eq!((calls, aborts), (1, 1));
    }
}
