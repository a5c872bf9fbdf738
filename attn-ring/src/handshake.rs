//! Start-up handshake: ranks exchange a fingerprint of (operation, config,
//! global shape, dtype, layout, strategy, world) and the result of their local
//! shape checks; any mismatch becomes the same `RankDisagreement` on every rank.

use attn_core::{AttnError, DType, Result};

use crate::comm::Communicator;
use crate::plan::RingProblem;

/// Fingerprint of what a rank is about to compute.
pub(crate) fn fingerprint(op: &str, problem: &RingProblem, dtype: DType) -> String {
    let c = &problem.cfg;
    format!(
        "op={op} segments={:?} rates={:?} mixing={} causal={} scale={:?} seq={} batch={} heads={} head_dim={} \
         dtype={} layout={} strategy={} world={}",
        c.segment_lengths(),
        c.dilation_rates(),
        c.mixing().as_str(),
        c.causal(),
        c.explicit_scale(),
        problem.seq,
        problem.batch,
        problem.heads,
        problem.head_dim,
        dtype.as_str(),
        problem.layout.as_str(),
        problem.strategy.as_str(),
        problem.world,
    )
}

/// Run the handshake. `local_error` is this rank's own check result (a bad local
/// shape); it is shared so that every rank fails the same way.
pub(crate) fn handshake<C: Communicator + ?Sized>(comm: &mut C, fp: &str, local_error: Option<String>) -> Result<()> {
    let mine = format!("{fp}\n{}", local_error.unwrap_or_default());
    let all = comm.all_gather(mine.into_bytes())?;
    let parsed: Vec<(String, String)> = all
        .into_iter()
        .map(|b| {
            let s = String::from_utf8_lossy(&b).into_owned();
            let (f, e) = s.split_once('\n').unwrap_or((&s, ""));
            (f.to_owned(), e.to_owned())
        })
        .collect();
    if let Some((r, (f, _))) = parsed.iter().enumerate().find(|(_, (f, _))| *f != parsed[0].0) {
        return Err(AttnError::RankDisagreement(format!("rank {r} has [{f}] but rank 0 has [{}]", parsed[0].0)));
    }
    if let Some((r, (_, e))) = parsed.iter().enumerate().find(|(_, (_, e))| !e.is_empty()) {
        return Err(AttnError::RankDisagreement(format!("rank {r} rejected its inputs: {e}")));
    }
    Ok(())
}
