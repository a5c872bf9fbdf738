//! Start-up handshake: ranks exchange a fingerprint of (operation, config,
//! global shape, dtype, layout, strategy, world) and the result of their local
//! checks (shapes, memory budget, finite inputs); any mismatch or refusal becomes
//! the same error on every rank, before anything proportional to the problem is
//! allocated or sent.

use attn_core::error::TensorName;
use attn_core::{AttnError, DType, Result};

use crate::comm::Communicator;
use crate::plan::RingProblem;

/// Why a rank will not compute, shared with every rank by the handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// A local input or output has the wrong shape: `RankDisagreement` everywhere.
    Inputs(String),
    /// The call's workspace exceeds this rank's budget: `OverBudget` everywhere.
    OverBudget { needed: u64, budget: u64 },
    /// A non-finite input value, at a flat index of the global tensor: `NonFinite` everywhere.
    NonFinite { tensor: TensorName, index: usize },
}

/// The tensors `check_finite` looks at, in checking order.
const CHECKED: [TensorName; 4] = [TensorName::Query, TensorName::Key, TensorName::Value, TensorName::GradOutput];

impl Refusal {
    fn encode(&self) -> String {
        match self {
            Refusal::Inputs(m) => format!("inputs {m}"),
            Refusal::OverBudget { needed, budget } => format!("budget {needed} {budget}"),
            Refusal::NonFinite { tensor, index } => {
                let t = CHECKED.iter().position(|c| c == tensor).unwrap_or(CHECKED.len());
                format!("finite {t} {index}")
            }
        }
    }

    fn decode(s: &str) -> Option<Refusal> {
        let (kind, rest) = s.split_once(' ').unwrap_or((s, ""));
        let nums: Vec<u64> = rest.split(' ').filter_map(|x| x.parse().ok()).collect();
        match (kind, nums.as_slice()) {
            ("", _) => None,
            ("budget", &[needed, budget]) => Some(Refusal::OverBudget { needed, budget }),
            ("finite", &[t, index]) => Some(Refusal::NonFinite {
                tensor: CHECKED.get(t as usize).copied().unwrap_or(TensorName::Other("input")),
                index: index as usize,
            }),
            _ => Some(Refusal::Inputs(rest.to_owned())),
        }
    }

    /// Checking order of a non-finite refusal: tensor first, then index.
    fn finite_key(&self) -> Option<(usize, usize)> {
        match self {
            Refusal::NonFinite { tensor, index } => Some((CHECKED.iter().position(|c| c == tensor)?, *index)),
            _ => None,
        }
    }
}

/// FNV-1a of the masks (key padding, packing, block mask), so ranks holding different masks disagree in the handshake.
fn masks_hash(problem: &RingProblem) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let mut eat = |x: u64| {
        for byte in x.to_le_bytes() {
            h = (h ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    };
    let m = problem.masks.view();
    eat(u64::from(m.key_padding.is_some()));
    m.key_padding.iter().flat_map(|k| k.flags()).for_each(|&f| eat(u64::from(f)));
    eat(u64::from(m.packing.is_some()));
    m.packing.iter().flat_map(|p| p.cu_seqlens()).for_each(|&c| eat(c as u64));
    eat(u64::from(m.block.is_some()));
    if let Some(b) = m.block {
        let d = b.dims();
        [d.batch, d.heads, d.q_blocks, d.k_blocks, b.block_size()].iter().for_each(|&x| eat(x as u64));
        b.keep().iter().for_each(|&k| eat(u64::from(k)));
    }
    h
}

/// Fingerprint of what a rank is about to compute.
pub(crate) fn fingerprint(op: &str, problem: &RingProblem, dtype: DType) -> String {
    let c = &problem.cfg;
    format!(
        "op={op} segments={:?} rates={:?} mixing={} window={:?} causal={} scale={:?} seq={} batch={} heads={} \
         kv_heads={} head_dim={} masks={:016x} dtype={} layout={} strategy={} world={}",
        c.segment_lengths(),
        c.dilation_rates(),
        c.mixing().as_str(),
        c.window().map(|w| (w.left, w.right)),
        c.causal(),
        c.explicit_scale(),
        problem.seq,
        problem.batch,
        problem.heads,
        problem.kv_heads,
        problem.head_dim,
        masks_hash(problem),
        dtype.as_str(),
        problem.layout.as_str(),
        problem.strategy.label(),
        problem.world,
    )
}

/// Run the handshake. `refusal` is this rank's own check result; it is shared so that
/// every rank fails the same way: a different fingerprint or a bad shape anywhere is
/// `RankDisagreement`, else a refused budget anywhere is `OverBudget` (of the lowest
/// such rank), else a non-finite input anywhere is `NonFinite` (the first tensor in
/// q, k, v, grad_out order, at its lowest global index).
pub(crate) fn handshake<C: Communicator + ?Sized>(comm: &mut C, fp: &str, refusal: Option<Refusal>) -> Result<()> {
    let mine = format!("{fp}\n{}", refusal.map(|r| r.encode()).unwrap_or_default());
    let all = comm.all_gather(mine.into_bytes())?;
    let parsed: Vec<(String, Option<Refusal>)> = all
        .into_iter()
        .map(|b| {
            let s = String::from_utf8_lossy(&b).into_owned();
            let (f, e) = s.split_once('\n').unwrap_or((&s, ""));
            (f.to_owned(), Refusal::decode(e))
        })
        .collect();
    if let Some((r, (f, _))) = parsed.iter().enumerate().find(|(_, (f, _))| *f != parsed[0].0) {
        return Err(AttnError::RankDisagreement(format!("rank {r} has [{f}] but rank 0 has [{}]", parsed[0].0)));
    }
    let refusals: Vec<(usize, &Refusal)> =
        parsed.iter().enumerate().filter_map(|(r, (_, e))| Some((r, e.as_ref()?))).collect();
    if let Some((r, Refusal::Inputs(e))) = refusals.iter().find(|(_, e)| matches!(e, Refusal::Inputs(_))) {
        return Err(AttnError::RankDisagreement(format!("rank {r} rejected its inputs: {e}")));
    }
    if let Some((_, Refusal::OverBudget { needed, budget })) =
        refusals.iter().find(|(_, e)| matches!(e, Refusal::OverBudget { .. }))
    {
        let size = |x: u64| usize::try_from(x).unwrap_or(usize::MAX);
        return Err(AttnError::OverBudget { needed: size(*needed), budget: size(*budget) });
    }
    if let Some(Refusal::NonFinite { tensor, index }) =
        refusals.iter().filter_map(|(_, e)| e.finite_key().map(|k| (k, *e))).min_by_key(|(k, _)| *k).map(|(_, e)| e)
    {
        return Err(AttnError::NonFinite { tensor: *tensor, index: *index });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_survive_the_wire() {
        for r in [
            Refusal::Inputs("q has shape [1, 2, 3, 4], expected [1, 3, 3, 4]".into()),
            Refusal::OverBudget { needed: u64::MAX, budget: 7 },
            Refusal::NonFinite { tensor: TensorName::GradOutput, index: 12345 },
            Refusal::NonFinite { tensor: TensorName::Query, index: 0 },
        ] {
            assert_eq!(Refusal::decode(&r.encode()), Some(r));
        }
        assert_eq!(Refusal::decode(""), None);
    }
}
