//! The op on in-process ring ranks: each rank's rows of the global inputs as burn
//! autodiff tensors, the op through its `RingBackend` (`attn_burn::attention_on`), burn's
//! `backward()` on every rank, and the ranks' rows put back together as one global [`Run`];
//! also behind the testkit's golden interface ([`BurnRing`]).

use std::sync::Arc;

use attn_burn::{AttnOptions, HostAttention, attention_on};
use attn_core::{AttnError, DType as AttnDType, KeyPaddingMask};
use attn_ring::{Communicator, Layout as RingLayout, RingBackend, Strategy, ThreadComm};
use attn_testkit::golden::{DilatedBackend, Forward32, Gradients32, Problem};
use burn_tensor::DType;

use super::golden_op::{options, problem_inputs};
use super::{Attended, Inputs, Layout, Run, run_inputs, values};

/// How the ranks split the problem.
#[derive(Debug, Clone, Copy)]
pub struct Split {
    pub world: usize,
    pub layout: RingLayout,
    pub strategy: Strategy,
}

/// Rows `pos` of a global row-major `[b, n, row]` buffer, as `[b, pos.len(), row]`.
pub fn rows_of(x: &[f32], [b, n, row]: [usize; 3], pos: &[usize]) -> Vec<f32> {
    (0..b)
        .flat_map(|bi| pos.iter().flat_map(move |&p| &x[(bi * n + p) * row..(bi * n + p + 1) * row]))
        .copied()
        .collect()
}

/// Writes a rank's `[b, pos.len(), row]` rows into the global `[b, n, row]` buffer.
pub fn put_rows(global: &mut [f32], local: &[f32], [b, n, row]: [usize; 3], pos: &[usize]) {
    for bi in 0..b {
        for (i, &p) in pos.iter().enumerate() {
            let from = (bi * pos.len() + i) * row;
            global[(bi * n + p) * row..(bi * n + p + 1) * row].copy_from_slice(&local[from..from + row]);
        }
    }
}

/// `opts` for a rank holding rows `pos`: its rows of the key padding mask (the ring gathers
/// them); packed sequences and block masks stay global.
pub fn rank_options(opts: &AttnOptions, pos: &[usize]) -> Result<AttnOptions, AttnError> {
    let Some(mask) = opts.masks.key_padding() else { return Ok(opts.clone()) };
    let mask = mask.view();
    let (b, n, flags) = (mask.batch(), mask.seq(), mask.flags());
    let local: Vec<bool> = (0..b).flat_map(|bi| pos.iter().map(move |&p| flags[bi * n + p])).collect();
    let mut masks = opts.masks.clone();
    masks = masks.with_key_padding(KeyPaddingMask::new(local, b, pos.len())?);
    Ok(AttnOptions { config: opts.config.clone(), masks })
}

/// One rank's run: its rows, the op through `backend`, burn's backward.
fn rank_run(
    backend: RingBackend<ThreadComm>,
    opts: &RankOptions<'_>,
    inputs: Inputs<'_>,
    dtype: DType,
) -> Result<(Vec<usize>, Run), AttnError> {
    let pos = backend.positions();
    let opts = opts(backend.with_comm(|c| Ok(c.rank()))?, &pos)?;
    let [qd, kd] = inputs.dims;
    let ([b, n, h, d], [_, _, kh, _]) = (qd, kd);
    let [q, k, v] = inputs.qkv;
    let (lq, lk, lv) =
        (rows_of(q, [b, n, h * d], &pos), rows_of(k, [b, n, kh * d], &pos), rows_of(v, [b, n, kh * d], &pos));
    let lgo = rows_of(inputs.grad_out, [b, n, h * d], &pos);
    let lgl = inputs.grad_lse.map(|g| rows_of(g, [b, n, h], &pos));
    let dims = [[b, pos.len(), h, d], [b, pos.len(), kh, d]];
    let backend: Arc<dyn HostAttention> = Arc::new(backend);
    let f = |q, k, v| {
        let r = attention_on(backend.clone(), q, k, v, &opts)?;
        Ok(Attended { out: r.out, lse_values: values(r.lse.clone()), lse: r.lse })
    };
    let local = Inputs { qkv: [&lq, &lk, &lv], grad_out: &lgo, grad_lse: lgl.as_deref(), dims };
    Ok((pos, run_inputs(local, &f, dtype, Layout::Bshd)?))
}

/// A rank's options from its rank and rows.
pub type RankOptions<'a> = dyn Fn(usize, &[usize]) -> Result<AttnOptions, AttnError> + Sync + 'a;

/// The op on `split.world` in-process ranks, each with its own options (`opts(rank,
/// rows)`), every rank's result.
pub fn ring_ranks(
    opts: &RankOptions<'_>,
    inputs: Inputs<'_>,
    dtype: DType,
    split: Split,
) -> Vec<Result<(Vec<usize>, Run), AttnError>> {
    let comms = ThreadComm::world(split.world).expect("thread communicators");
    let seq = inputs.dims[0][1];
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                s.spawn(move || {
                    let backend = RingBackend::new(comm, seq, split.layout, split.strategy)?;
                    rank_run(backend, opts, inputs, dtype)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

/// The op on `split.world` in-process ranks with the same options, put together as one
/// global run (the first rank's error, if any).
pub fn ring_run(opts: &AttnOptions, inputs: Inputs<'_>, dtype: DType, split: Split) -> Result<Run, AttnError> {
    let [[b, n, h, d], [_, _, kh, _]] = inputs.dims;
    let mut run = Run {
        out: vec![0.0; b * n * h * d],
        lse: vec![0.0; b * n * h],
        grads: [h, kh, kh].map(|heads| vec![0.0; b * n * heads * d]),
    };
    for rank in ring_ranks(&|_, pos| rank_options(opts, pos), inputs, dtype, split) {
        let (pos, local) = rank?;
        put_rows(&mut run.out, &local.out, [b, n, h * d], &pos);
        put_rows(&mut run.lse, &local.lse, [b, n, h], &pos);
        for ((g, l), heads) in run.grads.iter_mut().zip(&local.grads).zip([h, kh, kh]) {
            put_rows(g, l, [b, n, heads * d], &pos);
        }
    }
    Ok(run)
}

/// The op on ring ranks in one dtype behind the golden interface.
#[derive(Debug, Clone, Copy)]
pub struct BurnRing {
    pub dtype: (DType, AttnDType),
    pub split: Split,
}

impl BurnRing {
    fn run(
        &self,
        p: &Problem<'_>,
        qkv: [&[f32]; 3],
        grad_out: &[f32],
        grad_lse: Option<&[f32]>,
    ) -> attn_core::Result<Run> {
        ring_run(&options(p), problem_inputs(p, qkv, grad_out, grad_lse), self.dtype.0, self.split)
    }
}

impl DilatedBackend for BurnRing {
    fn name(&self) -> String {
        let Split { world, layout, strategy } = self.split;
        format!("burn-flex {} ring(p={world}, {}, {})", self.dtype.1.as_str(), layout.as_str(), strategy.as_str())
    }
    fn dtype(&self) -> AttnDType {
        self.dtype.1
    }
    fn forward(&self, p: &Problem<'_>, qkv: [&[f32]; 3]) -> attn_core::Result<Forward32> {
        // The gradients come along (every rank runs one backward); the files judge them
        // in `backward`.
        let zeros = vec![0.0; p.shape.q.numel()];
        let run = self.run(p, qkv, &zeros, None)?;
        Ok(Forward32 { out: run.out, lse: run.lse })
    }
    fn backward(&self, p: &Problem<'_>, qkv: [&[f32]; 3], grad_out: &[f32]) -> attn_core::Result<Gradients32> {
        let [dq, dk, dv] = self.run(p, qkv, grad_out, None)?.grads;
        Ok(Gradients32 { dq, dk, dv })
    }
    fn backward_lse(
        &self,
        p: &Problem<'_>,
        qkv: [&[f32]; 3],
        grad_out: &[f32],
        grad_lse: &[f32],
    ) -> attn_core::Result<Gradients32> {
        let [dq, dk, dv] = self.run(p, qkv, grad_out, Some(grad_lse))?.grads;
        Ok(Gradients32 { dq, dk, dv })
    }
}
