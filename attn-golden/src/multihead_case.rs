//! Running a `kind=multihead` conformance case (metadata + tensors) through the layer on one device or on ring ranks.

use std::collections::BTreeMap;
use std::sync::Arc;

use attn_core::{Attention, AttnError, KeyPadding, Masks, Result};
use attn_multihead::metadata::{config_from_metadata, flag, text};
use attn_multihead::{
    Call, Cross, ExtraTensors, LayerFloat, MultiheadConfig, MultiheadDilatedAttention, MultiheadWeights, TensorSource,
    load_params,
};
use attn_ring::{Layout, RingBackend, Strategy, ThreadComm};

/// A `kind=multihead` case ready to run: the layer config and weights, and the inputs.
#[derive(Debug, Clone)]
pub struct PreparedCase<F> {
    pub config: MultiheadConfig,
    pub weights: MultiheadWeights<F>,
    pub query: Vec<F>,
    /// `(key, value)` for cross-attention.
    pub key_value: Option<(Vec<F>, Vec<F>)>,
    pub batch: usize,
    pub q_seq: usize,
    pub kv_seq: usize,
}

/// Build the layer config from the metadata, load the weights from `tensors` (PyTorch
/// names), and read `query` (and `key`, `value` when `cross_attention` is true).
pub fn prepare_case<F: LayerFloat>(
    m: &BTreeMap<String, String>,
    tensors: &impl TensorSource,
) -> Result<PreparedCase<F>> {
    let kind = text(m, "kind")?;
    if kind != "multihead" {
        return Err(AttnError::Format(format!("kind=`{kind}` is not a multihead case")));
    }
    let config = config_from_metadata(m, tensors.tensor_shape("q_proj.bias").is_some().into())?;
    let mut weights = MultiheadWeights::<F>::magneto(&config, 0);
    load_params(&mut weights, tensors, ExtraTensors::Ignore)?;
    let (qshape, query) = tensors.read_tensor::<F>("query")?;
    let e = config.embed_dim;
    let dims = |s: &[usize], name: &str| -> Result<(usize, usize)> {
        match s {
            [b, n, x] if *x == e => Ok((*b, *n)),
            _ => Err(AttnError::Format(format!("`{name}` has shape {s:?}, expected [batch, seq, {e}]"))),
        }
    };
    let (batch, q_seq) = dims(&qshape, "query")?;
    let cross = m.get("cross_attention").map(|_| flag(m, "cross_attention")).transpose()?.unwrap_or(false);
    let (key_value, kv_seq) = if cross {
        let (kshape, key) = tensors.read_tensor::<F>("key")?;
        let (vshape, value) = tensors.read_tensor::<F>("value")?;
        let (kb, kv_seq) = dims(&kshape, "key")?;
        if kb != batch || vshape != kshape {
            return Err(AttnError::Format(format!("key {kshape:?} / value {vshape:?} disagree with query {qshape:?}")));
        }
        (Some((key, value)), kv_seq)
    } else {
        (None, q_seq)
    };
    Ok(PreparedCase { config, weights, query, key_value, batch, q_seq, kv_seq })
}

/// Run a `kind=multihead` case on `backend` with the file's key padding mask
/// (`[batch, seq]` flags, `true` = padding; self-attention files); returns the output
/// `[batch, seq, embed]`.
pub fn forward_case<F: LayerFloat>(
    m: &BTreeMap<String, String>,
    tensors: &impl TensorSource,
    key_padding: Option<&[bool]>,
    backend: Arc<dyn Attention<F>>,
) -> Result<Vec<F>> {
    let c = prepare_case::<F>(m, tensors)?;
    let layer = MultiheadDilatedAttention::from_weights(c.config, c.weights, backend)?;
    let key_padding = key_padding.map(|f| KeyPadding::new(f, c.batch, c.kv_seq)).transpose()?;
    let mut call = Call::new(c.batch, c.q_seq).masks(Masks { key_padding, ..Masks::NONE });
    if let Some((k, v)) = &c.key_value {
        call = call.cross(Cross::new(k, v, c.kv_seq));
    }
    layer.forward(&c.query, &call)
}

/// How a ring run splits a case: `world` in-process ranks, the layout, the strategy.
#[derive(Debug, Clone, Copy)]
pub struct RingSplit {
    pub world: usize,
    pub layout: Layout,
    pub strategy: Strategy,
}

/// The ring splits keys and queries alike: keys of their own length (cross-attention
/// with `kv_seq != q_seq`) are refused as the ring refuses them (`AttnError::Unsupported`).
pub(crate) fn ring_split_check<F>(c: &PreparedCase<F>) -> Result<()> {
    if c.kv_seq != c.q_seq {
        return Err(attn_ring::cross_attention_refused());
    }
    Ok(())
}

/// Rows `positions` of every batch of a `[batch, seq, e]` buffer.
pub(crate) fn gather_rows<T: Copy>(x: &[T], seq: usize, e: usize, positions: &[usize]) -> Vec<T> {
    let batch = x.len() / (seq * e).max(1);
    let mut out = Vec::with_capacity(batch * positions.len() * e);
    for b in 0..batch {
        for &p in positions {
            out.extend_from_slice(&x[(b * seq + p) * e..][..e]);
        }
    }
    out
}

/// One rank of a case on the ring: its layer, its global row positions and its rows of
/// the case's key padding mask (`[batch, rows]`).
pub(crate) struct RankCase {
    pub layer: MultiheadDilatedAttention<f32>,
    pub backend: Arc<RingBackend<ThreadComm>>,
    pub pos: Vec<usize>,
    pub key_padding: Option<Vec<bool>>,
}

impl RankCase {
    /// The rank's masks (its rows of the key padding).
    pub fn masks(&self, batch: usize) -> Result<Masks<'_>> {
        let key_padding = self.key_padding.as_deref().map(|r| KeyPadding::new(r, batch, self.pos.len())).transpose()?;
        Ok(Masks { key_padding, ..Masks::NONE })
    }
}

/// Run `f` on every rank of `split` (one thread each, [`ThreadComm`]); returns each
/// rank's positions and result, in rank order.
pub(crate) fn run_ranks<R: Send>(
    c: &PreparedCase<f32>,
    split: RingSplit,
    key_padding: Option<&[bool]>,
    f: impl Fn(&RankCase) -> Result<R> + Sync,
) -> Result<Vec<(Vec<usize>, R)>> {
    let RingSplit { world, layout, strategy } = split;
    ring_split_check(c)?;
    let comms = ThreadComm::world(world)?;
    let f = &f;
    let ranks: Vec<Result<(Vec<usize>, R)>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                s.spawn(move || -> Result<(Vec<usize>, R)> {
                    let backend = Arc::new(RingBackend::new(comm, c.q_seq, layout, strategy)?);
                    let pos = backend.positions();
                    let layer =
                        MultiheadDilatedAttention::from_weights(c.config.clone(), c.weights.clone(), backend.clone())?;
                    let key_padding = key_padding.map(|flags| gather_rows(flags, c.q_seq, 1, &pos));
                    let rank = RankCase { layer, backend, pos, key_padding };
                    let r = f(&rank)?;
                    Ok((rank.pos, r))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(AttnError::InvalidArgument("a rank panicked".into()))))
            .collect()
    });
    ranks.into_iter().collect()
}

/// Put a rank's rows `y` (`[batch, pos.len(), e]`) at their positions of `out` (`[batch, seq, e]`).
pub(crate) fn scatter_rows<T: Copy>(out: &mut [T], y: &[T], seq: usize, e: usize, pos: &[usize]) {
    let batch = out.len() / (seq * e).max(1);
    for b in 0..batch {
        for (j, &p) in pos.iter().enumerate() {
            out[(b * seq + p) * e..][..e].copy_from_slice(&y[(b * pos.len() + j) * e..][..e]);
        }
    }
}

/// Run a `kind=multihead` case on `split.world` in-process ranks
/// ([`ThreadComm`]) with the sequence split by the layout and attention by the strategy,
/// each rank passing its rows of the key padding mask; returns the assembled output.
/// Cross-attention needs keys as long as the queries (one split for both; otherwise
/// `AttnError::Unsupported`).
pub fn forward_case_ring(
    m: &BTreeMap<String, String>,
    tensors: &impl TensorSource,
    key_padding: Option<&[bool]>,
    split: RingSplit,
) -> Result<Vec<f32>> {
    let c = prepare_case::<f32>(m, tensors)?;
    let (e, seq, batch) = (c.config.embed_dim, c.q_seq, c.batch);
    let ranks = run_ranks(&c, split, key_padding, |r| {
        let q = gather_rows(&c.query, seq, e, &r.pos);
        let call = Call::new(batch, r.pos.len()).masks(r.masks(batch)?);
        match &c.key_value {
            None => r.layer.forward(&q, &call),
            Some((k, v)) => {
                let (k, v) = (gather_rows(k, seq, e, &r.pos), gather_rows(v, seq, e, &r.pos));
                r.layer.forward(&q, &call.cross(Cross::new(&k, &v, r.pos.len())))
            }
        }
    })?;
    let mut out = vec![0f32; batch * seq * e];
    for (pos, y) in ranks {
        scatter_rows(&mut out, &y, seq, e, &pos);
    }
    Ok(out)
}
