//! `NcclComm`: ranks are GPUs joined by NCCL (cudarc, dynamic loading, feature
//! `nccl`). Frames travel in two grouped NCCL rounds (lengths, then bytes) and
//! completion is polled with a CUDA event until the timeout. Without the feature,
//! or on a machine without a CUDA driver, NCCL library or GPU, construction is a
//! typed error, never a panic.
//!
//! The only `unsafe` here is probing for the CUDA and NCCL libraries.
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
    }
}

#[cfg(feature = "nccl")]
mod imp {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
    use cudarc::nccl::{Comm, Id, result as nccl};

    use super::*;
    use crate::comm::{Communicator, DEFAULT_TIMEOUT, Framing};

    fn unavailable(reason: impl Into<String>) -> AttnError {
        AttnError::BackendUnavailable { backend: "NCCL", reason: reason.into() }
    }

    fn nccl_err(rank: usize, what: &str, e: impl std::fmt::Debug) -> AttnError {
        AttnError::Comm { rank, message: format!("NCCL {what}: {e:?}") }
    }

    pub fn available() -> Result<usize> {
        // SAFETY: only tries to dlopen the CUDA driver library; no symbol is called.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(unavailable("no CUDA driver (libcuda) on this machine"));
        }
        // SAFETY: only tries to dlopen libnccl; no symbol is called.
        if !unsafe { cudarc::nccl::sys::is_culib_present() } {
            return Err(unavailable("the NCCL library (libnccl.so) was not found"));
        }
        let n = CudaContext::device_count().map_err(|e| unavailable(format!("cuDeviceGetCount: {e:?}")))?;
        if n <= 0 {
            return Err(unavailable("no GPU"));
        }
        Ok(n as usize)
    }

    /// One GPU rank of an NCCL communicator.
    pub struct NcclComm {
        comm: Comm,
        stream: Arc<CudaStream>,
        rank: usize,
        world: usize,
        timeout: Duration,
        framing: Framing,
    }

    impl std::fmt::Debug for NcclComm {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("NcclComm").field("rank", &self.rank).field("world", &self.world).finish_non_exhaustive()
        }
    }

    impl NcclComm {
        /// A fresh NCCL unique id (create on one rank, send to the others out of band).
        pub fn unique_id() -> Result<[u8; NCCL_ID_BYTES]> {
            available()?;
            let id = Id::new().map_err(|e| nccl_err(0, "get unique id", e))?;
            Ok(id.internal().map(|c| c as u8))
        }

        /// Join the communicator `id` as `rank` of `world`, on GPU `device`.
        pub fn new(rank: usize, world: usize, device: usize, id: &[u8; NCCL_ID_BYTES]) -> Result<Self> {
            let n = available()?;
            if device >= n || rank >= world {
                return Err(AttnError::InvalidArgument(format!(
                    "rank {rank} of {world} on GPU {device} (this machine has {n})"
                )));
            }
            let ctx = CudaContext::new(device).map_err(|e| unavailable(format!("CUDA context: {e:?}")))?;
            let stream = ctx.new_stream().map_err(|e| unavailable(format!("CUDA stream: {e:?}")))?;
            let id = Id::uninit(id.map(|b| b as std::ffi::c_char));
            let comm = Comm::from_rank(stream.clone(), rank, world, id).map_err(|e| nccl_err(rank, "init", e))?;
            Ok(NcclComm { comm, stream, rank, world, timeout: DEFAULT_TIMEOUT, framing: Framing::new(rank, world) })
        }

        /// Change the timeout.
        pub fn set_timeout(&mut self, timeout: Duration) {
            self.timeout = timeout;
        }

        /// Wait for the stream's queued NCCL work, polling an event until the timeout.
        fn wait(&self, peer: usize) -> Result<()> {
            let ev = self.stream.record_event(None).map_err(|e| nccl_err(self.rank, "record event", e))?;
            let deadline = Instant::now() + self.timeout;
            while !ev.is_complete() {
                if Instant::now() > deadline {
                    let timeout_ms = self.timeout.as_millis() as u64;
                    return Err(AttnError::Timeout { rank: self.rank, peer, timeout_ms });
                }
                std::thread::sleep(Duration::from_micros(20));
            }
            Ok(())
        }

        /// One grouped round: send `out[i]` to `to[i]`, receive `lens[j]` bytes from `from[j]`.
        fn round(&self, out: &[(usize, &[u8])], from: &[usize], lens: &[usize]) -> Result<Vec<Vec<u8>>> {
            let r = self.rank;
            let s = &self.stream;
            let dev_out: Vec<CudaSlice<u8>> = out
                .iter()
                .map(|(_, b)| s.clone_htod(if b.is_empty() { &[0u8][..] } else { b }))
                .collect::<std::result::Result<_, _>>()
                .map_err(|e| nccl_err(r, "copy to device", e))?;
            let mut dev_in: Vec<CudaSlice<u8>> = lens
                .iter()
                .map(|&n| s.alloc_zeros::<u8>(n.max(1)))
                .collect::<std::result::Result<_, _>>()
                .map_err(|e| nccl_err(r, "alloc", e))?;
            nccl::group_start().map_err(|e| nccl_err(r, "group start", e))?;
            for ((peer, _), buf) in out.iter().zip(&dev_out) {
                self.comm.send(buf, *peer as i32).map_err(|e| nccl_err(r, "send", e))?;
            }
            for (peer, buf) in from.iter().zip(dev_in.iter_mut()) {
                self.comm.recv(buf, *peer as i32).map_err(|e| nccl_err(r, "recv", e))?;
            }
            nccl::group_end().map_err(|e| nccl_err(r, "group end", e))?;
            self.wait(from.first().copied().unwrap_or(r))?;
            dev_in
                .iter()
                .zip(lens)
                .map(|(d, &n)| {
                    s.clone_dtoh(d).map(|mut v| {
                        v.truncate(n);
                        v
                    })
                })
                .collect::<std::result::Result<_, _>>()
                .map_err(|e| nccl_err(r, "copy to host", e))
        }
    }

    impl Communicator for NcclComm {
        fn rank(&self) -> usize {
            self.rank
        }
        fn world_size(&self) -> usize {
            self.world
        }
        fn timeout(&self) -> Duration {
            self.timeout
        }

        fn exchange_frames(&mut self, sends: Vec<(usize, Vec<u8>)>, recv_from: &[usize]) -> Result<Vec<Vec<u8>>> {
            // Round 1: lengths (8 bytes each); round 2: the frames, padded to at least one byte.
            let lens: Vec<[u8; 8]> = sends.iter().map(|(_, f)| (f.len() as u64).to_le_bytes()).collect();
            let out: Vec<(usize, &[u8])> = sends.iter().zip(&lens).map(|((p, _), l)| (*p, &l[..])).collect();
            let got = self.round(&out, recv_from, &vec![8; recv_from.len()])?;
            let sizes: Vec<usize> =
                got.iter().map(|b| u64::from_le_bytes(b[..8].try_into().unwrap_or([0; 8])) as usize).collect();
            let out: Vec<(usize, &[u8])> = sends.iter().map(|(p, f)| (*p, &f[..])).collect();
            let padded: Vec<usize> = sizes.iter().map(|&n| n.max(1)).collect();
            let mut frames = self.round(&out, recv_from, &padded)?;
            for (f, &n) in frames.iter_mut().zip(&sizes) {
                f.truncate(n);
            }
            Ok(frames)
        }

        fn framing(&mut self) -> &mut Framing {
            &mut self.framing
        }
        fn framing_ref(&self) -> &Framing {
            &self.framing
        }
    }
}

pub use imp::NcclComm;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn construction_is_a_typed_error_without_nccl_or_a_gpu() {
        match nccl_available() {
            Ok(_) => gpu_round_trip(),
            Err(e) => {
                assert!(matches!(e, AttnError::NotCompiled { .. } | AttnError::BackendUnavailable { .. }), "{e}");
                let id = [0u8; NCCL_ID_BYTES];
                let err = NcclComm::new(0, 1, 0, &id).unwrap_err();
                assert!(matches!(err, AttnError::NotCompiled { .. } | AttnError::BackendUnavailable { .. }), "{err}");
                assert!(NcclComm::unique_id().is_err());
            }
        }
    }

    /// On a GPU machine: a one-rank communicator moves frames through NCCL (to itself).
    #[cfg(feature = "nccl")]
    fn gpu_round_trip() {
        use crate::comm::Communicator;
        let id = NcclComm::unique_id().expect("unique id");
        let mut c = NcclComm::new(0, 1, 0, &id).expect("one-rank NCCL communicator");
        let frames = vec![(0, vec![1u8, 2, 3, 250]), (0, (0..=255).collect::<Vec<u8>>())];
        let got = c.exchange_frames(frames.clone(), &[0, 0]).expect("NCCL self exchange");
        assert_eq!(got, frames.into_iter().map(|(_, f)| f).collect::<Vec<_>>());
        assert_eq!(c.all_gather(vec![9, 8]).expect("all_gather"), vec![vec![9, 8]]);
    }

    #[cfg(not(feature = "nccl"))]
    fn gpu_round_trip() {}
}
