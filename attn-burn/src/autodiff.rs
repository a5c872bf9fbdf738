//! [`DilatedAttentionBackend`] for `Autodiff<B>`: the forward runs `B`'s and registers
//! two backward nodes (burn's `Backward` trait, prepared through `OpsPrep`), one per
//! result, each keeping q, k, v, the output and the LSE; the output's node runs `B`'s
//! exact backward of its gradient, the LSE's node that of the LSE's gradient (the
//! gradients are linear in them, so burn's sum of the two is the whole gradient). The
//! forward is never recomputed, and a loss that does not use the LSE never runs its
//! node.

use std::sync::Arc;

use attn_core::Result;
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_backend::tensor::FloatTensor;

use crate::backend::{AttnPrimitives, DilatedAttentionBackend, InputGrads, SavedForward, Upstream};
use crate::compute::Compute;
use crate::options::AttnOptions;

/// Which result of the call a backward node differentiates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Output {
    Out,
    Lse,
}

/// The backward node of one result of one attention call.
#[derive(Debug)]
struct DilatedAttentionBackward(Output);

/// What the node keeps: the saved forward of the inner backend, the options and where
/// the call computed (its backward computes there too).
#[derive(Debug, Clone)]
struct NodeState<B: DilatedAttentionBackend> {
    saved: SavedForward<B>,
    options: Arc<AttnOptions>,
    compute: Compute,
}

impl<B: DilatedAttentionBackend> Backward<B, 3> for DilatedAttentionBackward {
    type State = NodeState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_q, node_k, node_v] = ops.parents;
        let grad = Some(grads.consume::<B>(&ops.node));
        let upstream = match self.0 {
            Output::Out => Upstream { grad_out: grad, grad_lse: None },
            Output::Lse => Upstream { grad_out: None, grad_lse: grad },
        };
        let NodeState { saved, options, compute } = ops.state;
        // The forward checked every input, dtype and mask against these same tensors, so
        // the backward cannot meet bad input; a failure here is a kernel fault (or, on ring
        // ranks, a communication fault or ranks whose losses reach different results), and
        // burn's backward step has no error channel.
        let InputGrads { dq, dk, dv } = match B::dilated_attention_backward(saved, upstream, &options, &compute) {
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
        compute: &Compute,
    ) -> Result<AttnPrimitives<Self>> {
        // One set of input guards for each result's node.
        let lse_nodes = [q.node(), k.node(), v.node()];
        let (qp, q_node) = q.into_parts();
        let (kp, k_node) = k.into_parts();
        let (vp, v_node) = v.into_parts();
        let AttnPrimitives { out, lse } =
            B::dilated_attention_with_lse(qp.clone(), kp.clone(), vp.clone(), options, compute)?;
        let saved = SavedForward { q: qp, k: kp, v: vp, out: out.clone(), lse: lse.clone() };
        let state = NodeState { saved, options: Arc::new(options.clone()), compute: compute.clone() };
        let node = |result: Output, nodes, value: FloatTensor<B>| {
            let prep = DilatedAttentionBackward(result).prepare::<C>(nodes).compute_bound().stateful();
            match prep {
                OpsKind::Tracked(prep) => prep.finish(state.clone(), value),
                OpsKind::UnTracked(prep) => prep.finish(value),
            }
        };
        let out = node(Output::Out, [q_node, k_node, v_node], out);
        Ok(AttnPrimitives { out, lse: node(Output::Lse, lse_nodes, lse) })
    }

    fn dilated_attention_backward(
        saved: SavedForward<Self>,
        upstream: Upstream<Self>,
        options: &AttnOptions,
        compute: &Compute,
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
        let upstream = Upstream {
            grad_out: upstream.grad_out.map(|g| g.into_primitive()),
            grad_lse: upstream.grad_lse.map(|g| g.into_primitive()),
        };
        let InputGrads { dq, dk, dv } = B::dilated_attention_backward(inner, upstream, options, compute)?;
        let wrap = FloatTensor::<Self>::new;
        Ok(InputGrads { dq: wrap(dq), dk: wrap(dk), dv: wrap(dv) })
    }
}
