//! Gradients of a `kind=multihead` conformance case (a file with `grad_out`): the layer's
//! training forward and backward on any backend, named as the files name them.

use std::collections::BTreeMap;
use std::sync::Arc;

use attn_core::{Attention, AttnError, KeyPadding, Masks, Result};
use attn_multihead::{
    Call, Cross, InputGrads, LayerFloat, MultiheadDilatedAttention, MultiheadWeights, NamedParams, TensorSource,
};

use crate::multihead_case::{PreparedCase, RingSplit, gather_rows, prepare_case, run_ranks, scatter_rows};

/// A case's output and the gradients of `sum(out * grad_out)`, named as golden files
/// name them: `d_query` (`d_key`, `d_value` in cross-attention) and `d.<parameter>`.
#[derive(Debug, Clone, PartialEq)]
pub struct CaseGrads<F> {
    pub out: Vec<F>,
    pub grads: Vec<(String, Vec<F>)>,
}

impl<F: Copy> CaseGrads<F> {
    fn new(out: Vec<F>, input: InputGrads<F>, params: &MultiheadWeights<F>) -> Self {
        let mut grads = vec![("d_query".to_string(), input.query)];
        grads.extend(input.key.map(|k| ("d_key".to_string(), k)));
        grads.extend(input.value.map(|v| ("d_value".to_string(), v)));
        grads.extend(params.params().into_iter().map(|p| (format!("d.{}", p.name), p.data.to_vec())));
        CaseGrads { out, grads }
    }
}

/// The case's `grad_out`, which must be `[batch, q_seq, embed]`.
fn grad_out<F: LayerFloat>(c: &PreparedCase<F>, tensors: &impl TensorSource) -> Result<Vec<F>> {
    let (shape, g) = tensors.read_tensor::<F>("grad_out")?;
    let want = [c.batch, c.q_seq, c.config.embed_dim];
    if shape != want {
        return Err(AttnError::Format(format!("`grad_out` has shape {shape:?}, expected {want:?}")));
    }
    Ok(g)
}

/// Run a `kind=multihead` case with `grad_out` on `backend`: the training forward (no
/// dropout) and the backward, with the file's key padding mask (`[batch, kv_seq]`).
pub fn backward_case<F: LayerFloat>(
    m: &BTreeMap<String, String>,
    tensors: &impl TensorSource,
    key_padding: Option<&[bool]>,
    backend: Arc<dyn Attention<F>>,
) -> Result<CaseGrads<F>> {
    let c = prepare_case::<F>(m, tensors)?;
    let go = grad_out(&c, tensors)?;
    let layer = MultiheadDilatedAttention::from_weights(c.config.clone(), c.weights.clone(), backend)?;
    let key_padding = key_padding.map(|f| KeyPadding::new(f, c.batch, c.kv_seq)).transpose()?;
    let mut call = Call::new(c.batch, c.q_seq).masks(Masks { key_padding, ..Masks::NONE });
    if let Some((k, v)) = &c.key_value {
        call = call.cross(Cross::new(k, v, c.kv_seq));
    }
    let (out, cache) = layer.forward_train(&c.query, &call)?;
    let mut grads = layer.zero_grads();
    let input = layer.backward(&cache, &go, &mut grads)?;
    Ok(CaseGrads::new(out, input, &grads))
}

/// [`backward_case`] on `split.world` in-process ranks: each rank runs its
/// rows, the weight gradients are all-reduced over the ranks, the row outputs and input
/// gradients assembled. Keys of their own length are `AttnError::Unsupported`.
pub fn backward_case_ring(
    m: &BTreeMap<String, String>,
    tensors: &impl TensorSource,
    key_padding: Option<&[bool]>,
    split: RingSplit,
) -> Result<CaseGrads<f32>> {
    let c = prepare_case::<f32>(m, tensors)?;
    let go = grad_out(&c, tensors)?;
    let (e, seq, batch) = (c.config.embed_dim, c.q_seq, c.batch);
    let ranks = run_ranks(&c, split, key_padding, |r| {
        let rows = |x: &[f32]| gather_rows(x, seq, e, &r.pos);
        let (n, masks) = (r.pos.len(), r.masks(batch)?);
        let call = Call::new(batch, n).masks(masks);
        let (y, cache) = match &c.key_value {
            None => r.layer.forward_train(&rows(&c.query), &call)?,
            Some((k, v)) => {
                let (k, v) = (rows(k), rows(v));
                r.layer.forward_train(&rows(&c.query), &call.cross(Cross::new(&k, &v, n)))?
            }
        };
        let mut grads = r.layer.zero_grads();
        let input = r.layer.backward(&cache, &rows(&go), &mut grads)?;
        r.backend.with_comm(|comm| attn_multihead::all_reduce_grads(comm, &mut grads))?;
        Ok(CaseGrads::new(y, input, &grads))
    })?;
    let is_param = |name: &str| name.starts_with("d.");
    let mut total: Option<CaseGrads<f32>> = None;
    for (pos, rank) in ranks {
        let t = total.get_or_insert_with(|| CaseGrads {
            out: vec![0.0; batch * seq * e],
            // Parameter gradients are whole on every rank; input gradients are `[batch, seq, embed]`.
            grads: rank
                .grads
                .iter()
                .map(|(n, g)| (n.clone(), vec![0.0; if is_param(n) { g.len() } else { batch * seq * e }]))
                .collect(),
        });
        scatter_rows(&mut t.out, &rank.out, seq, e, &pos);
        for ((name, all), (_, g)) in t.grads.iter_mut().zip(&rank.grads) {
            if is_param(name) {
                // Every rank holds the all-reduced total.
                all.copy_from_slice(g);
            } else {
                scatter_rows(all, g, seq, e, &pos);
            }
        }
    }
    total.ok_or_else(|| AttnError::InvalidArgument("a ring of no ranks".into()))
}
