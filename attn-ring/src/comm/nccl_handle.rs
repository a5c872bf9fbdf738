//! `NcclHandle`: one rank's NCCL communicator created *non-blocking*
//! (`ncclCommInitRankConfig` with `blocking = 0`), the only place attn-ring calls NCCL
//! through raw handles. No NCCL call can then block the calling thread: creation and
//! the launch of a grouped round return at once (or with `ncclInProgress`) and are
//! finished by polling `ncclCommGetAsyncError`, the round itself by polling a CUDA
//! event, all through [`await_progress`](super::nccl_progress::await_progress) against
//! one deadline. A failure or a missed deadline aborts the communicator
//! (`ncclCommAbort`, which also stops NCCL kernels spinning on a peer), and the handle
//! refuses further rounds. A blocking communicator could hang: its lazy connection
//! setup inside `ncclGroupEnd`, and its creation, wait on every peer with no timeout.
//! `Drop` aborts rather than destroys (`ncclCommDestroy` waits for pending work).
#![allow(unsafe_code)]

use std::ffi::{CStr, c_int, c_void};
use std::sync::Arc;
use std::time::{Duration, Instant};

use attn_core::{AttnError, Result};
use cudarc::driver::{CudaEvent, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};
#[cfg(feature = "cuda")]
use cudarc::driver::{CudaSlice, DeviceRepr};
use cudarc::nccl::sys;

use super::nccl_library::{IN_PROGRESS, NcclLibrary, SUCCESS, Status, UINT8, is_error, nccl_library};
use super::nccl_progress::{Progress, await_progress};

/// `NCCL_VERSION(2, 30, 0)`: the `ncclConfig_t` layout cudarc's `nccl-02030` bindings
/// declare. An older library reads the prefix it knows (NCCL copies
/// `min(config.size, its own size)` bytes) and every field here is "undefined" except
/// `blocking`, so the same config is valid for NCCL 2.17 and later.
const CONFIG_VERSION: u32 = 2 * 10_000 + 30 * 100;
/// `NCCL_CONFIG_UNDEF_INT`: let NCCL choose.
const UNDEF: c_int = c_int::MIN;

/// A round NCCL has enqueued: the event after its operations and its deadline.
pub(crate) struct PostedRound {
    event: CudaEvent,
    peer: usize,
    timeout: Duration,
    deadline: Instant,
}

/// A non-blocking NCCL communicator of one rank (see the module docs).
pub(crate) struct NcclHandle {
    nccl: &'static NcclLibrary,
    comm: sys::ncclComm_t,
    rank: usize,
    /// Set once the communicator has been aborted; every later round is refused.
    aborted: bool,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are
// not concurrent; `NcclHandle` is only used through `&mut self` (or dropped).
unsafe impl Send for NcclHandle {}

impl std::fmt::Debug for NcclHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclHandle").field("rank", &self.rank).field("aborted", &self.aborted).finish()
    }
}

/// The config of `NCCL_CONFIG_INITIALIZER` with `blocking = 0`.
fn nonblocking_config() -> sys::ncclConfig_t {
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: CONFIG_VERSION,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

#[cfg(feature = "cuda")]
/// The bytes of a device buffer, for a round (every bit pattern is a valid `u8`).
pub(crate) fn bytes_of<T: DeviceRepr>(buf: &CudaSlice<T>) -> Option<CudaView<'_, u8>> {
    let n = buf.num_bytes();
    // SAFETY: the view covers exactly the buffer's bytes and `u8` has no invalid values
    // and alignment 1 (`transmute` returns `None` only for a longer view).
    unsafe { buf.transmute::<u8>(n) }
}

#[cfg(feature = "cuda")]
/// The bytes of a device buffer to receive into.
pub(crate) fn bytes_of_mut<T: DeviceRepr>(buf: &mut CudaSlice<T>) -> Option<CudaViewMut<'_, u8>> {
    let n = buf.num_bytes();
    // SAFETY: as in `bytes_of`; any bytes written make valid `T` values only for the
    // plain numeric `T` the chunk ring sends (f32, f16, bf16).
    unsafe { buf.transmute_mut::<u8>(n) }
}

fn to_c_int(rank: usize, what: &str, n: usize) -> Result<c_int> {
    c_int::try_from(n)
        .map_err(|_| AttnError::Comm { rank, message: format!("NCCL {what} {n} exceeds the C int range") })
}

impl NcclHandle {
    /// Join communicator `id` as `rank` of `world` on the calling thread's current CUDA
    /// device, waiting at most `timeout` for every rank to join. A rank that never
    /// joins is `Timeout` naming rank 0 (the id's root; rank 1 on rank 0): which rank
    /// is missing cannot be known from here.
    pub(crate) fn join(rank: usize, world: usize, id: &[u8; 128], timeout: Duration) -> Result<Self> {
        let nccl = nccl_library()?;
        let deadline = Instant::now() + timeout;
        let (nranks, me) = (to_c_int(rank, "world size", world)?, to_c_int(rank, "rank", rank)?);
        let unique = sys::ncclUniqueId { internal: id.map(|b| b as std::ffi::c_char) };
        let mut config = nonblocking_config();
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` and `config` are live locals that NCCL only reads (`config`) or
        // writes (`comm`, the new handle, set also when the call returns InProgress).
        let started = unsafe { (nccl.comm_init_rank_config)(&mut comm, nranks, unique, me, &mut config) };
        let failed = is_error(started);
        if comm.is_null() {
            let why = if failed { nccl.describe(started) } else { "no communicator returned".into() };
            return Err(AttnError::Comm { rank, message: format!("NCCL init: {why}") });
        }
        let mut handle = NcclHandle { nccl, comm, rank, aborted: false };
        if failed {
            handle.abort();
            return Err(AttnError::Comm { rank, message: format!("NCCL init: {}", nccl.describe(started)) });
        }
        let root = if rank == 0 { 1 } else { 0 };
        handle.settle(root, timeout, deadline)?;
        Ok(handle)
    }

    /// Error unless the communicator can still run rounds.
    pub(crate) fn usable(&self) -> Result<()> {
        if self.aborted {
            return Err(AttnError::Comm {
                rank: self.rank,
                message: "the NCCL communicator was aborted after an earlier failure or timeout".into(),
            });
        }
        Ok(())
    }

    /// One grouped round on `stream`: every send and receive posted between
    /// `ncclGroupStart` and `ncclGroupEnd`, then polled until the stream has run them
    /// (or the deadline passes: `Timeout` naming `peer`). Counts are bytes; matched
    /// pairs must agree on them.
    pub(crate) fn round(
        &mut self,
        stream: &Arc<CudaStream>,
        sends: &[(usize, CudaView<'_, u8>)],
        recvs: &mut [(usize, CudaViewMut<'_, u8>)],
        peer: usize,
        timeout: Duration,
    ) -> Result<()> {
        let posted = self.post(stream, sends, recvs, peer, timeout)?;
        self.wait(posted)
    }

    /// Post a round (as [`Self::round`]) and return once NCCL has enqueued it on
    /// `stream`; [`Self::wait`] finishes it. Every buffer must stay allocated and
    /// unchanged until then (or until the communicator is aborted).
    pub(crate) fn post(
        &mut self,
        stream: &Arc<CudaStream>,
        sends: &[(usize, CudaView<'_, u8>)],
        recvs: &mut [(usize, CudaViewMut<'_, u8>)],
        peer: usize,
        timeout: Duration,
    ) -> Result<PostedRound> {
        self.usable()?;
        let deadline = Instant::now() + timeout;
        let cu_stream = stream.cu_stream() as sys::cudaStream_t;
        let to: Vec<c_int> = sends.iter().map(|(p, _)| to_c_int(self.rank, "peer", *p)).collect::<Result<_>>()?;
        let from: Vec<c_int> = recvs.iter().map(|(p, _)| to_c_int(self.rank, "peer", *p)).collect::<Result<_>>()?;
        let nccl = self.nccl;
        let mut failed: Option<String> = None;
        // SAFETY: ncclGroupStart takes no arguments; it opens this thread's group.
        let started = unsafe { (nccl.group_start)() };
        if is_error(started) {
            return Err(self.fail(format!("ncclGroupStart: {}", nccl.describe(started))));
        }
        // cudarc's records of each buffer's use, made when they drop: kept until the round
        // is enqueued, so a buffer freed later waits for the NCCL kernel, not just its post.
        let mut uses = Vec::with_capacity(sends.len() + recvs.len());
        for ((_, buf), &to) in sends.iter().zip(&to) {
            let (ptr, used) = buf.device_ptr(stream);
            uses.push(used);
            // SAFETY: `ptr` addresses `buf.len()` live device bytes that the buffer behind
            // the view keeps allocated until this round's event has completed or the
            // communicator is aborted (the caller borrows it past `round`); `comm` is live.
            let posted = unsafe { (nccl.send)(ptr as *const c_void, buf.len(), UINT8, to, self.comm, cu_stream) };
            if is_error(posted) {
                failed.get_or_insert(format!("ncclSend to {to}: {}", nccl.describe(posted)));
            }
        }
        for ((_, buf), &from) in recvs.iter_mut().zip(&from) {
            let len = buf.len();
            let (ptr, used) = buf.device_ptr_mut(stream);
            uses.push(used);
            // SAFETY: as for the sends; `buf` is not read until the round has completed.
            let posted = unsafe { (nccl.recv)(ptr as *mut c_void, len, UINT8, from, self.comm, cu_stream) };
            if is_error(posted) {
                failed.get_or_insert(format!("ncclRecv from {from}: {}", nccl.describe(posted)));
            }
        }
        // The group is closed even after a failed post, so this thread's group depth stays 0.
        // SAFETY: closes the group opened above on this thread.
        let ended = unsafe { (nccl.group_end)() };
        if is_error(ended) {
            failed.get_or_insert(format!("ncclGroupEnd: {}", nccl.describe(ended)));
        }
        if let Some(why) = failed {
            return Err(self.fail(why));
        }
        // Launch: until NCCL says the operations are enqueued, an event would mean nothing.
        self.settle(peer, timeout, deadline)?;
        let event = match stream.record_event(None) {
            Ok(ev) => ev,
            Err(e) => return Err(self.fail(format!("record event: {e:?}"))),
        };
        drop(uses);
        Ok(PostedRound { event, peer, timeout, deadline })
    }

    /// Wait until a posted round has run (or its deadline passes: `Timeout`, and the
    /// communicator is aborted).
    pub(crate) fn wait(&mut self, round: PostedRound) -> Result<()> {
        self.usable()?;
        let PostedRound { event, peer, timeout, deadline } = round;
        let (nccl, comm) = (self.nccl, self.comm);
        let rank = self.rank;
        let aborted = &mut self.aborted;
        await_progress(
            rank,
            peer,
            timeout,
            deadline,
            || {
                // A CUDA error (a kernel fault beside the round) fails the round at once,
                // rather than reading as "not yet" until the deadline blames a peer.
                match event.try_is_complete() {
                    Ok(true) => return Progress::Done,
                    Ok(false) => {}
                    Err(e) => return Progress::Failed(format!("the round's CUDA event: {e:?}")),
                }
                match poll_async_error(nccl, comm) {
                    // NCCL has no error: the work is still running on the stream.
                    Progress::Done => Progress::Pending,
                    other => other,
                }
            },
            || abort_raw(nccl, comm, aborted),
        )
    }

    /// Poll the asynchronous state until no operation is in progress.
    fn settle(&mut self, peer: usize, timeout: Duration, deadline: Instant) -> Result<()> {
        let (nccl, comm) = (self.nccl, self.comm);
        let aborted = &mut self.aborted;
        await_progress(
            self.rank,
            peer,
            timeout,
            deadline,
            || poll_async_error(nccl, comm),
            || abort_raw(nccl, comm, aborted),
        )
    }

    /// Abort and describe the failure as this rank's `Comm` error.
    fn fail(&mut self, message: String) -> AttnError {
        self.abort();
        AttnError::Comm { rank: self.rank, message: format!("NCCL {message}") }
    }

    /// Abort the communicator (once): its pending operations are cancelled, so buffers
    /// they use can be freed, and every later round is refused.
    pub(crate) fn abort(&mut self) {
        abort_raw(self.nccl, self.comm, &mut self.aborted);
    }
}

/// `ncclCommGetAsyncError` as a [`Progress`]: `Pending` while an operation is in
/// progress, `Done` when none is (for a launched round that only means "enqueued": its
/// completion is the stream event's), `Failed` with NCCL's own message on an error.
fn poll_async_error(nccl: &NcclLibrary, comm: sys::ncclComm_t) -> Progress {
    let mut state: Status = SUCCESS;
    // SAFETY: `comm` is a live, not yet aborted communicator (callers poll only before
    // aborting) and `state` is a live local.
    let asked = unsafe { (nccl.comm_get_async_error)(comm, &mut state) };
    let code = if is_error(asked) { asked } else { state };
    match code {
        IN_PROGRESS => Progress::Pending,
        c if !is_error(c) => Progress::Done,
        c => Progress::Failed(format!("NCCL asynchronous error {}: {}", nccl.describe(c), last_error(nccl, comm))),
    }
}

/// NCCL's text for the last error on `comm` (empty when it has none).
fn last_error(nccl: &NcclLibrary, comm: sys::ncclComm_t) -> String {
    // SAFETY: `comm` is live; NCCL returns null or a NUL-terminated string it owns,
    // copied here before any other NCCL call.
    unsafe {
        let text = (nccl.get_last_error)(comm);
        if text.is_null() { String::new() } else { CStr::from_ptr(text).to_string_lossy().into_owned() }
    }
}

/// Abort `comm` once; later calls do nothing.
fn abort_raw(nccl: &NcclLibrary, comm: sys::ncclComm_t, aborted: &mut bool) {
    if !*aborted {
        *aborted = true;
        // SAFETY: `comm` is live and, with `aborted` now set, never used again. The
        // result is ignored: nothing more can be done with a communicator being torn down.
        let _ = unsafe { (nccl.comm_abort)(comm) };
    }
}

impl Drop for NcclHandle {
    fn drop(&mut self) {
        self.abort();
    }
}
