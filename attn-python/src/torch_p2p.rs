//! `TorchP2p`: the ring's grouped point-to-point rounds carried by a Python transport
//! object over a torch.distributed process group (`attn_dilated.distributed`'s
//! `_Transport`), so `attn_ring::GroupedComm` runs its length-then-frame protocol,
//! handshake and completion over the ranks' own group.
//!
//! The transport's `group(sends, recvs, timeout)` posts every send (`(peer, bytearray)`)
//! and receive (`(peer, length)`) as one batch and returns the received `bytes` in
//! receive order once all are complete; it raises `TimeoutError` (with the waited-for
//! `peer` as an attribute where known) when the deadline passes first, and any other
//! exception on a transport failure. The ring computes with the interpreter released;
//! each round takes it back for the call.

use std::time::Duration;

use attn_core::{AttnError, Result};
use attn_ring::comm::GroupedP2p;
use pyo3::exceptions::PyTimeoutError;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes};

/// One rank's grouped rounds through a Python transport object.
#[derive(Debug)]
pub struct TorchP2p {
    rank: usize,
    world: usize,
    timeout: Duration,
    transport: Py<PyAny>,
}

impl TorchP2p {
    /// Rank `rank` of `world` in the transport's group; every round waits at most `timeout`.
    pub fn new(transport: Py<PyAny>, rank: usize, world: usize, timeout: Duration) -> Result<Self> {
        if world == 0 || rank >= world {
            return Err(AttnError::InvalidArgument(format!("rank {rank} outside a world of {world} ranks")));
        }
        Ok(TorchP2p { rank, world, timeout, transport })
    }

    /// The attn error for the transport's exception: `Timeout` for `TimeoutError` (its
    /// `peer` attribute, else the first peer of the round), `Comm` for any other.
    fn error(&self, py: Python<'_>, err: PyErr, first_peer: usize) -> AttnError {
        if err.is_instance_of::<PyTimeoutError>(py) {
            let peer = err.value(py).getattr("peer").and_then(|p| p.extract::<usize>()).unwrap_or(first_peer);
            let timeout_ms = u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX);
            return AttnError::Timeout { rank: self.rank, peer, timeout_ms };
        }
        AttnError::Comm { rank: self.rank, message: format!("torch.distributed transport: {err}") }
    }
}

impl GroupedP2p for TorchP2p {
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

    fn group(&mut self, sends: &[(usize, &[u8])], recvs: &[(usize, usize)]) -> Result<Vec<Vec<u8>>> {
        let first_peer = recvs.first().map(|r| r.0).or(sends.first().map(|s| s.0)).unwrap_or(self.rank);
        Python::attach(|py| {
            let payloads: Vec<(usize, Bound<'_, PyByteArray>)> =
                sends.iter().map(|&(p, bytes)| (p, PyByteArray::new(py, bytes))).collect();
            let args = (payloads, recvs.to_vec(), self.timeout.as_secs_f64());
            let got = self.transport.bind(py).call_method1("group", args).map_err(|e| self.error(py, e, first_peer))?;
            let got: Vec<Bound<'_, PyBytes>> = got.extract().map_err(|e| AttnError::Comm {
                rank: self.rank,
                message: format!("the transport returned no list of bytes: {e}"),
            })?;
            if got.len() != recvs.len() {
                return Err(AttnError::Comm {
                    rank: self.rank,
                    message: format!("the transport returned {} frames for {} receives", got.len(), recvs.len()),
                });
            }
            let mut out = Vec::with_capacity(got.len());
            for (b, &(peer, len)) in got.iter().zip(recvs) {
                let bytes = b.as_bytes();
                if bytes.len() != len {
                    return Err(AttnError::Comm {
                        rank: self.rank,
                        message: format!("{} bytes from rank {peer} where {len} were posted", bytes.len()),
                    });
                }
                out.push(bytes.to_vec());
            }
            Ok(out)
        })
    }
}
