//! `NcclComm`: ranks are GPUs joined by NCCL (feature `nccl`; the library opened at run
//! time by `nccl_library`). `NcclP2p` runs one grouped NCCL round on a non-blocking communicator
//! (`nccl_handle`: `ncclGroupStart`, sends, receives, `ncclGroupEnd`, then NCCL's
//! asynchronous state and a CUDA event polled against one deadline; a failure or a
//! missed deadline aborts the communicator) and `NcclComm` is the
//! [`GroupedComm`](super::GroupedComm) protocol over it: every
//! exchange is a round of lengths then a round of frames, and frames posted without
//! a receive travel with the rank's next exchange (NCCL sends complete only when the
//! peer posts the matching receive; see `grouped` for why this cannot deadlock and
//! `nccl_emu` for the GPU-free model it is tested on). Without the feature,
//! or on a machine without a CUDA driver, NCCL library or GPU, construction is a
//! typed error, never a panic.
//!
//! The only `unsafe` here is probing for the CUDA driver; the NCCL calls themselves are
//! in `nccl_handle` and `nccl_library`.
#![cfg_attr(feature = "nccl", allow(unsafe_code))]

use attn_core::{AttnError, Result};

/// Bytes of an NCCL unique id (shared out of band, e.g. over MPI, before `new`).
pub const NCCL_ID_BYTES: usize = 128;

/// Error unless a CUDA driver, the NCCL library and at least one GPU are present.
/// Returns the number of GPUs.
pub fn nccl_available() -> Result<usize> {
    imp::available()
}

#[cfg(not(feature = "nccl"))]
mod imp {
    use super::*;

    pub fn available() -> Result<usize> {
        Err(AttnError::NotCompiled { backend: "NCCL", feature: "nccl" })
    }

    /// NCCL communicator; this build has no NCCL support.
    #[derive(Debug)]
    pub struct NcclComm {
        _private: (),
    }

    impl NcclComm {
        /// A fresh NCCL unique id; always an error in this build.
        pub fn unique_id() -> Result<[u8; NCCL_ID_BYTES]> {
            Err(AttnError::NotCompiled { backend: "NCCL", feature: "nccl" })
        }
        /// Always an error in this build.
        pub fn new(_rank: usize, _world: usize, _device: usize, _id: &[u8; NCCL_ID_BYTES]) -> Result<Self> {
            Err(AttnError::NotCompiled { backend: "NCCL", feature: "nccl" })
        }
        /// Always an error in this build.
        pub fn bootstrap<C: crate::comm::Communicator + ?Sized>(
            _over: &mut C,
            _device: usize,
            _timeout: std::time::Duration,
        ) -> Result<Self> {
            Err(AttnError::NotCompiled { backend: "NCCL", feature: "nccl" })
        }
        /// Always an error in this build.
        pub fn with_timeout(
            _rank: usize,
            _world: usize,
            _device: usize,
            _id: &[u8; NCCL_ID_BYTES],
            _timeout: std::time::Duration,
        ) -> Result<Self> {
            Err(AttnError::NotCompiled { backend: "NCCL", feature: "nccl" })
        }
    }
}

#[cfg(feature = "nccl")]
mod imp {
    use std::sync::Arc;
    use std::time::Duration;

    use cudarc::driver::{CudaContext, CudaSlice, CudaStream};

    use super::*;
    use crate::comm::DEFAULT_TIMEOUT;
    use crate::comm::grouped::{GroupedComm, GroupedP2p};
    use crate::comm::nccl_handle::NcclHandle;
    use crate::comm::nccl_library::nccl_library;

    fn unavailable(reason: impl Into<String>) -> AttnError {
        AttnError::BackendUnavailable { backend: "NCCL", reason: reason.into() }
    }

    fn nccl_err(rank: usize, what: &str, e: impl std::fmt::Debug) -> AttnError {
        AttnError::Comm { rank, message: format!("NCCL {what}: {e:?}") }
    }

    pub fn available() -> Result<usize> {
        if !attn_kernels::cuda::driver_library_present() {
            return Err(unavailable("no CUDA driver (libcuda) on this machine"));
        }
        nccl_library()?;
        let n = CudaContext::device_count().map_err(|e| unavailable(format!("cuDeviceGetCount: {e:?}")))?;
        if n <= 0 {
            return Err(unavailable("no GPU"));
        }
        Ok(n as usize)
    }

    /// One GPU rank of a non-blocking NCCL communicator, seen as grouped p2p rounds
    /// that return within the timeout (see `nccl_handle`).
    pub struct NcclP2p {
        /// Declared before `stream`, so it is dropped (aborted, cancelling any pending
        /// operation) before the stream it used goes away.
        handle: NcclHandle,
        stream: Arc<CudaStream>,
        rank: usize,
        world: usize,
        timeout: Duration,
    }

    /// One GPU rank of an NCCL communicator (see [`GroupedComm`] for the protocol:
    /// frames posted with `post` travel with this rank's next exchange).
    pub type NcclComm = GroupedComm<NcclP2p>;

    impl std::fmt::Debug for NcclP2p {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("NcclP2p")
                .field("rank", &self.rank)
                .field("world", &self.world)
                .field("handle", &self.handle)
                .finish_non_exhaustive()
        }
    }

    impl GroupedComm<NcclP2p> {
        /// A fresh NCCL unique id (create on one rank, send to the others out of band).
        pub fn unique_id() -> Result<[u8; NCCL_ID_BYTES]> {
            available()?;
            nccl_library()?.unique_id().map_err(|e| AttnError::Comm { rank: 0, message: format!("NCCL {e}") })
        }

        /// Join the communicator `id` as `rank` of `world`, on GPU `device`, with the
        /// default timeout.
        pub fn new(rank: usize, world: usize, device: usize, id: &[u8; NCCL_ID_BYTES]) -> Result<Self> {
            Self::with_timeout(rank, world, device, id, DEFAULT_TIMEOUT)
        }

        /// Join an NCCL communicator with the ranks of `over` (e.g. an `MpiComm`, one
        /// process per GPU), this rank on GPU `device`: rank 0 makes the unique id and
        /// sends it to the others through `over`. When rank 0 cannot make one, every rank
        /// gets the same typed error (no rank waits for a communicator that never forms).
        pub fn bootstrap<C: crate::comm::Communicator + ?Sized>(
            over: &mut C,
            device: usize,
            timeout: Duration,
        ) -> Result<Self> {
            let (rank, world) = (over.rank(), over.world_size());
            let id = share_unique_id(over)?;
            Self::with_timeout(rank, world, device, &id, timeout)
        }

        /// Join the communicator `id` as `rank` of `world`, on GPU `device`; joining and
        /// every later round wait at most `timeout`.
        pub fn with_timeout(
            rank: usize,
            world: usize,
            device: usize,
            id: &[u8; NCCL_ID_BYTES],
            timeout: Duration,
        ) -> Result<Self> {
            Ok(GroupedComm::with_transport(NcclP2p::new(rank, world, device, id, timeout)?))
        }
    }

    /// A unique id made on rank 0 of `over` and sent to every rank through it; when rank 0
    /// cannot make one, every rank gets a typed error (no rank waits for a communicator
    /// that never forms).
    pub(crate) fn share_unique_id<C: crate::comm::Communicator + ?Sized>(over: &mut C) -> Result<[u8; NCCL_ID_BYTES]> {
        let rank = over.rank();
        let made = if rank == 0 { Some(NcclComm::unique_id()) } else { None };
        let offer = match &made {
            Some(Ok(id)) => id.to_vec(),
            _ => Vec::new(),
        };
        let ids = over.all_gather(offer)?;
        if let Some(Err(e)) = made {
            return Err(e);
        }
        ids[0].as_slice().try_into().map_err(|_| AttnError::Comm {
            rank,
            message: "rank 0 could not make an NCCL unique id (see its error)".into(),
        })
    }

    impl NcclP2p {
        /// Join the communicator `id` as `rank` of `world`, on GPU `device`, waiting at
        /// most `timeout` for the other ranks to join (`Timeout` if one never does).
        pub fn new(
            rank: usize,
            world: usize,
            device: usize,
            id: &[u8; NCCL_ID_BYTES],
            timeout: Duration,
        ) -> Result<Self> {
            let n = available()?;
            if device >= n || rank >= world {
                return Err(AttnError::InvalidArgument(format!(
                    "rank {rank} of {world} on GPU {device} (this machine has {n})"
                )));
            }
            let ctx = CudaContext::new(device).map_err(|e| unavailable(format!("CUDA context: {e:?}")))?;
            let stream = ctx.new_stream().map_err(|e| unavailable(format!("CUDA stream: {e:?}")))?;
            ctx.bind_to_thread().map_err(|e| nccl_err(rank, "bind the CUDA context", e))?;
            let handle = NcclHandle::join(rank, world, id, timeout)?;
            Ok(NcclP2p { handle, stream, rank, world, timeout })
        }
    }

    impl GroupedP2p for NcclP2p {
        fn rank(&self) -> usize {
            self.rank
        }
        fn world_size(&self) -> usize {
            self.world
        }
        fn timeout(&self) -> Duration {
            self.timeout
        }
        fn set_timeout(&mut self, timeout: Duration) {
            self.timeout = timeout;
        }

        /// One grouped round. Empty buffers travel as one byte on both sides (both know
        /// the length), since a matched pair must have equal counts.
        fn group(&mut self, sends: &[(usize, &[u8])], recvs: &[(usize, usize)]) -> Result<Vec<Vec<u8>>> {
            let r = self.rank;
            self.handle.usable()?;
            let s = &self.stream;
            s.context().bind_to_thread().map_err(|e| nccl_err(r, "bind the CUDA context", e))?;
            let dev_out: Vec<(usize, CudaSlice<u8>)> = sends
                .iter()
                .map(|&(peer, b)| s.clone_htod(if b.is_empty() { &[0u8][..] } else { b }).map(|d| (peer, d)))
                .collect::<std::result::Result<_, _>>()
                .map_err(|e| nccl_err(r, "copy to device", e))?;
            let mut dev_in: Vec<(usize, CudaSlice<u8>)> = recvs
                .iter()
                .map(|&(peer, n)| s.alloc_zeros::<u8>(n.max(1)).map(|d| (peer, d)))
                .collect::<std::result::Result<_, _>>()
                .map_err(|e| nccl_err(r, "alloc", e))?;
            let first_peer = recvs.first().map(|x| x.0).or(sends.first().map(|x| x.0)).unwrap_or(r);
            let out_views: Vec<_> = dev_out.iter().map(|(p, d)| (*p, d.as_view())).collect();
            let mut in_views: Vec<_> = dev_in.iter_mut().map(|(p, d)| (*p, d.as_view_mut())).collect();
            self.handle.round(s, &out_views, &mut in_views, first_peer, self.timeout)?;
            drop((out_views, in_views));
            let received = dev_in
                .iter()
                .zip(recvs)
                .map(|((_, d), &(_, n))| {
                    s.clone_dtoh(d).map(|mut v| {
                        v.truncate(n);
                        v
                    })
                })
                .collect::<std::result::Result<_, _>>();
            // A failed copy leaves the communicator in an unknown state: abort it, so no
            // later round waits on it.
            received.map_err(|e| {
                self.handle.abort();
                nccl_err(r, "copy to host", e)
            })
        }
    }
}

pub use imp::NcclComm;
#[cfg(feature = "nccl")]
pub use imp::NcclP2p;
#[cfg(all(feature = "nccl", feature = "cuda"))]
pub(crate) use imp::share_unique_id;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_rank_round_trip_on_a_gpu_else_a_typed_error() {
        match nccl_available() {
            Ok(_) => gpu_round_trip(),
            Err(e) => {
                assert!(matches!(e, AttnError::NotCompiled { .. } | AttnError::BackendUnavailable { .. }), "{e}");
                // Built with `nccl` but no GPU or library: a skip of the GPU half, which
                // `ATTN_REQUIRE_GPU=1` turns into a failure naming what is missing.
                if matches!(e, AttnError::BackendUnavailable { .. }) {
                    let test = "one_rank_round_trip_on_a_gpu_else_a_typed_error (GPU round trip)";
                    attn_testkit::skip_gpu_test(test, &e);
                }
                let id = [0u8; NCCL_ID_BYTES];
                let err = NcclComm::new(0, 1, 0, &id).unwrap_err();
                assert!(matches!(err, AttnError::NotCompiled { .. } | AttnError::BackendUnavailable { .. }), "{err}");
                assert!(NcclComm::unique_id().is_err());
                // Bootstrapped over threads: rank 0 has no id to give, every rank fails.
                let over = crate::comm::ThreadComm::world(2).expect("thread world");
                let got: Vec<Result<NcclComm>> = std::thread::scope(|s| {
                    let hs: Vec<_> = over
                        .into_iter()
                        .map(|mut c| s.spawn(move || NcclComm::bootstrap(&mut c, 0, std::time::Duration::from_secs(5))))
                        .collect();
                    hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
                });
                let typed = |r: &Result<NcclComm>| {
                    matches!(
                        r,
                        Err(AttnError::NotCompiled { .. }
                            | AttnError::BackendUnavailable { .. }
                            | AttnError::Comm { .. })
                    )
                };
                assert!(got.iter().all(typed), "{got:?}");
            }
        }
    }

    /// On a GPU machine: one NCCL round to itself through `NcclP2p`, then a one-rank
    /// communicator (frames to itself stay local), then a two-rank communicator whose
    /// other rank never joins: a `Timeout` within the timeout, not a hang (a blocking
    /// `ncclCommInitRank` waits for it forever). Two real ranks need two GPUs.
    #[cfg(feature = "nccl")]
    fn gpu_round_trip() {
        use std::time::{Duration, Instant};

        use crate::comm::{Communicator, GroupedP2p, NcclP2p};
        let id = NcclComm::unique_id().expect("unique id");
        let mut p2p = NcclP2p::new(0, 1, 0, &id, Duration::from_secs(30)).expect("one-rank NCCL transport");
        let big: Vec<u8> = (0..=255).collect();
        let got = p2p.group(&[(0, &[1u8, 2, 3, 250][..]), (0, &big[..]), (0, &[][..])], &[(0, 4), (0, 256), (0, 0)]);
        assert_eq!(got.expect("NCCL self round"), vec![vec![1, 2, 3, 250], big, vec![]]);
        let mut c = NcclComm::new(0, 1, 0, &NcclComm::unique_id().expect("unique id")).expect("communicator");
        let frames = vec![(0, vec![1u8, 2, 3, 250]), (0, (0..=255).collect::<Vec<u8>>())];
        let got = c.exchange_frames(frames.clone(), &[0, 0]).expect("self exchange");
        assert_eq!(got, frames.into_iter().map(|(_, f)| f).collect::<Vec<_>>());
        assert_eq!(c.all_gather(vec![9, 8]).expect("all_gather"), vec![vec![9, 8]]);

        let timeout = Duration::from_secs(3);
        let start = Instant::now();
        let lonely = NcclComm::with_timeout(0, 2, 0, &NcclComm::unique_id().expect("unique id"), timeout);
        let waited = start.elapsed();
        assert!(
            matches!(lonely, Err(AttnError::Timeout { rank: 0, peer: 1, timeout_ms: 3000 })),
            "a peer that never joins: {lonely:?}"
        );
        assert!(waited < timeout + Duration::from_secs(10), "gave up only after {waited:?}");
    }

    #[cfg(not(feature = "nccl"))]
    fn gpu_round_trip() {}
}
