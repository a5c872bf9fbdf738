//! [`DilatedAttentionBackend`] for `Autodiff<B>`: the forward runs `B`'s and registers a
//! backward node (burn's `Backward` trait, prepared through `OpsPrep`) that keeps q, k,
//! v, the output and the LSE, and whose backward runs `B`'s exact backward from them: the
//! forward is never recomputed. The LSE comes back as a constant (no gradient flows
//! through it).

use std::sync::Arc;

use attn_core::Result;
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_backend::tensor::FloatTensor;

use crate::backend::{AttnPrimitives, DilatedAttentionBackend, InputGrads, SavedForward};
use crate::options::AttnOptions;

/// The backward node of one attention call.
#[derive(Debug)]
struct DilatedAttentionBackward;

/// What the node keeps: the saved forward of the inner backend and the options.
#[derive(Debug, Clone)]
struct NodeState<B: DilatedAttentionBackend> {
    saved: SavedForward<B>,
    options: Arc<AttnOptions>,
}

impl<B: DilatedAttentionBackend> Backward<B, 3> for DilatedAttentionBackward {
    type State = NodeState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_q, node_k, node_v] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let NodeState { saved, options } = ops.state;
        // The forward checked every input, dtype and mask against these same tensors, so
        // the backward cannot meet bad input; a failure here is a kernel fault, and burn's
        // backward step has no error channel.
        let InputGrads { dq, dk, dv } = match B::dilated_attention_backward(saved, grad, &options) {
            Ok(g) => g,
            Err(e) => panic!("dilated attention backward failed after a successful forward: {e}"),
        };
        for (node, g) in [(node_q, dq), (node_k, dk), (node_v, dv)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, g);
            }
        }
    }
}

impl<B: DilatedAttentionBackend, C: CheckpointStrategy> DilatedAttentionBackend for Autodiff<B, C> {
    fn dilated_attention_with_lse(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        options: &AttnOptions,
    ) -> Result<AttnPrimitives<Self>> {
        let (qp, q_node) = q.into_parts();
        let (kp, k_node) = k.into_parts();
        let (vp, v_node) = v.into_parts();
        let AttnPrimitives { out, lse } = B::dilated_attention_with_lse(qp.clone(), kp.clone(), vp.clone(), options)?;
        let lse_const = FloatTensor::<Self>::new(lse.clone());
        let prep = DilatedAttentionBackward.prepare::<C>([q_node, k_node, v_node]).compute_bound().stateful();
        let out = match prep {
            OpsKind::Tracked(prep) => {
                let saved = SavedForward { q: qp, k: kp, v: vp, out: out.clone(), lse };
                prep.finish(NodeState { saved, options: Arc::new(options.clone()) }, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(out),
        };
        Ok(AttnPrimitives { out, lse: lse_const })
    }

    fn dilated_attention_backward(
        saved: SavedForward<Self>,
        grad_out: FloatTensor<Self>,
        options: &AttnOptions,
    ) -> Result<InputGrads<Self>> {
        // The backward as an operation of its own (no graph through it): the inner
        // backend's on the primitives.
        let inner = SavedForward {
            q: saved.q.into_primitive(),
            k: saved.k.into_primitive(),
            v: saved.v.into_primitive(),
            out: saved.out.into_primitive(),
            lse: saved.lse.into_primitive(),
        };
        let InputGrads { dq, dk, dv } = B::dilated_attention_backward(inner, grad_out.into_primitive(), options)?;
        let wrap = FloatTensor::<Self>::new;
        Ok(InputGrads { dq: wrap(dq), dk: wrap(dk), dv: wrap(dv) })
    }
}
