//! The ring-parallel layer over 2 to 4 in-process ranks equals the single-rank layer: outputs, input and weight gradients, in evaluation and in training with dropout.

use std::sync::Arc;

use attn_core::{AttnError, BlockDims, BlockMaskBuf, DType, DilatedConfig, Masks, MemoryBudget, Mixing, Pass};
use attn_multihead::{
    Call, EncoderConfig, LongNetEncoder, Mode, MultiheadConfig, MultiheadDilatedAttention, MultiheadWeights,
    NamedParams, ReferenceBackend, all_reduce_grads, ring_layer,
};
use attn_ring::{Layout, RingBackend, RingOptions, Strategy, ThreadComm, problem_for, ring_workspace_bytes};
use attn_testkit::rng::random_vec;
use attn_testkit::tolerance::{Tolerance, rel_l2_error};

/// Rows `positions` of every batch of `[batch, seq, e]`.
fn gather(x: &[f32], batch: usize, seq: usize, e: usize, positions: &[usize]) -> Vec<f32> {
    let mut out = Vec::with_capacity(batch * positions.len() * e);
    for b in 0..batch {
        for &p in positions {
            out.extend_from_slice(&x[(b * seq + p) * e..][..e]);
        }
    }
    out
}

fn scatter(dst: &mut [f32], src: &[f32], batch: usize, seq: usize, e: usize, positions: &[usize]) {
    for b in 0..batch {
        for (j, &p) in positions.iter().enumerate() {
            dst[(b * seq + p) * e..][..e].copy_from_slice(&src[(b * positions.len() + j) * e..][..e]);
        }
    }
}

fn norm(x: impl Iterator<Item = f64>) -> f64 {
    x.map(|v| v * v).sum::<f64>().sqrt()
}

/// The single-rank (f64 reference) output, input gradient and weight gradients.
fn single_rank(
    single: &MultiheadDilatedAttention<f64>,
    x: &[f32],
    g: &[f32],
    batch: usize,
    seq: usize,
    (mode, masks): (Mode, Masks<'_>),
) -> (Vec<f64>, Vec<f64>, MultiheadWeights<f64>) {
    let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let g64: Vec<f64> = g.iter().map(|&v| v as f64).collect();
    let (y, cache) = single.forward_train(&x64, &Call::new(batch, seq).mode(mode).masks(masks)).unwrap();
    let mut grads = single.weights.zeros_like();
    let dx = single.backward(&cache, &g64, &mut grads).unwrap().query;
    (y, dx, grads)
}

fn check(cfg: MultiheadConfig, world: usize, layout: Layout, strategy: Strategy, batch: usize, seq: usize) {
    check_mode(cfg, (world, layout, strategy), batch, seq, Mode::Eval);
}

fn check_mode(
    cfg: MultiheadConfig,
    (world, layout, strategy): (usize, Layout, Strategy),
    batch: usize,
    seq: usize,
    mode: Mode,
) {
    check_masked(cfg, (world, layout, strategy), batch, seq, (mode, Masks::NONE));
}

/// [`check_mode`] under `masks` (every rank passes the same global masks).
fn check_masked(
    cfg: MultiheadConfig,
    (world, layout, strategy): (usize, Layout, Strategy),
    batch: usize,
    seq: usize,
    (mode, masks): (Mode, Masks<'_>),
) {
    let e = cfg.embed_dim;
    let single = MultiheadDilatedAttention::<f64>::new(cfg.clone(), 11, Arc::new(ReferenceBackend)).unwrap();
    let mut w32 = MultiheadWeights::<f32>::magneto(&cfg, 0);
    for (d, s) in w32.params_mut().into_iter().zip(single.weights.params()) {
        d.data.iter_mut().zip(s.data).for_each(|(a, &b)| *a = b as f32);
    }
    let x = random_vec(1, batch * seq * e);
    let g = random_vec(2, batch * seq * e);
    let (y_want, dx_want, grads_want) = single_rank(&single, &x, &g, batch, seq, (mode, masks));
    if masks.block.is_some() {
        // The comparison below is about the block mask: it must change the output.
        let (y_all, _, _) = single_rank(&single, &x, &g, batch, seq, (mode, Masks::NONE));
        assert!(rel_l2_error(&y_all, &y_want) > 1e-2, "the block mask changed nothing");
    }
    if mode != Mode::Eval && cfg.dropout > 0.0 {
        // The comparison below is about dropout: the masks must change the output.
        let (y_eval, _, _) = single_rank(&single, &x, &g, batch, seq, (Mode::Eval, masks));
        assert!(rel_l2_error(&y_eval, &y_want) > 0.1, "dropout changed nothing");
    }

    let comms = ThreadComm::world(world).unwrap();
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (cfg, w32, x, g) = (cfg.clone(), w32.clone(), &x, &g);
                s.spawn(move || {
                    let backend = Arc::new(RingBackend::new(comm, seq, layout, strategy).unwrap());
                    let pos = backend.positions();
                    let layer = ring_layer(cfg, w32, backend.clone()).unwrap();
                    let xl = gather(x, batch, seq, e, &pos);
                    let call = Call::new(batch, pos.len()).mode(mode).masks(masks);
                    let (y, c) = layer.forward_train(&xl, &call).unwrap();
                    let mut grads = layer.weights.zeros_like();
                    let dx = layer.backward(&c, &gather(g, batch, seq, e, &pos), &mut grads).unwrap().query;
                    backend.with_comm(|c| all_reduce_grads(c, &mut grads)).unwrap();
                    (pos, y, dx, grads)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let (mut y, mut dx) = (vec![f32::NAN; x.len()], vec![f32::NAN; x.len()]);
    for (pos, yl, dxl, _) in &results {
        scatter(&mut y, yl, batch, seq, e, pos);
        scatter(&mut dx, dxl, batch, seq, e, pos);
    }
    let bound = Tolerance::for_dtype(DType::F32).rel_l2;
    let what = format!("p={world} {layout:?} {strategy:?} {mode:?}");
    assert!(rel_l2_error(&y, &y_want) <= bound, "{what} out {:.2e}", rel_l2_error(&y, &y_want));
    assert!(rel_l2_error(&dx, &dx_want) <= bound, "{what} dx {:.2e}", rel_l2_error(&dx, &dx_want));
    let first = &results[0].3;
    for (_, _, _, gr) in &results {
        assert_eq!(gr, first, "every rank holds the same reduced gradients");
    }
    let k_weight =
        norm(grads_want.params().into_iter().find(|p| p.name == "k_proj.weight").unwrap().data.iter().copied());
    for (got, want) in first.params().into_iter().zip(grads_want.params()) {
        if got.name == "k_proj.bias" {
            // Exactly zero: every query's softmax is invariant to adding `q . b_k` to all
            // of its scores, so a relative error is meaningless. Both are round-off
            // small next to the key weight gradient (same upstream dk, unit-scale inputs).
            let (g_got, g_want) = (norm(got.data.iter().map(|&v| v as f64)), norm(want.data.iter().copied()));
            assert!(g_want <= 1e-12 * k_weight, "{what}: reference d k_proj.bias {g_want:.2e}");
            let diff = norm(got.data.iter().zip(want.data).map(|(&a, &b)| a as f64 - b));
            assert!(diff <= bound * k_weight, "{what}: d k_proj.bias {g_got:.2e} vs |d k_proj.weight| {k_weight:.2e}");
            continue;
        }
        let err = rel_l2_error(got.data, want.data);
        assert!(err <= bound, "{what} d {} {err:.2e}", got.name);
    }
}

/// A per-head block mask over the global sequence (blocks of 5, a ragged last one), on 3
/// ranks in both layouts: the ring layer equals the single-rank reference layer under the
/// same mask.
#[test]
fn ring_layer_under_a_block_mask_equals_one_rank() {
    let cfg = MultiheadConfig::new(16, 4, DilatedConfig::new(&[8, 16], &[1, 2]).unwrap());
    let seq = 37;
    let dims = BlockDims { batch: 1, heads: 4, q_blocks: 8, k_blocks: 8 };
    let mask = BlockMaskBuf::from_fn(dims, 5, |_, h, i, j| i == j || (2 * i + j + h) % 3 == 0).unwrap();
    let masks = Masks { block: Some(mask.view()), ..Masks::NONE };
    for layout in [Layout::Contiguous, Layout::Zigzag] {
        check_masked(cfg.clone(), (3, layout, Strategy::Auto), 2, seq, (Mode::Eval, masks));
    }
}

#[test]
fn ring_layer_equals_one_rank_head_groups() {
    let cfg = MultiheadConfig::new(16, 4, DilatedConfig::new(&[8, 16], &[1, 2]).unwrap());
    check(cfg.clone(), 2, Layout::Contiguous, Strategy::Auto, 2, 37);
    check(cfg, 3, Layout::Zigzag, Strategy::Ring, 1, 40);
}

#[test]
fn ring_layer_equals_one_rank_longnet_causal() {
    let cfg = MultiheadConfig::new(
        16,
        2,
        DilatedConfig::builder()
            .segments(&[8, 32])
            .dilations(&[1, 4])
            .mixing(Mixing::LongNet)
            .causal()
            .build()
            .unwrap(),
    );
    check(cfg.clone(), 3, Layout::Contiguous, Strategy::AllGather, 1, 45);
    check(cfg, 2, Layout::Zigzag, Strategy::Auto, 1, 33);
}

/// Training mode with dropout: masks are drawn at global positions, so every split
/// (2 to 4 ranks, contiguous and zigzag) equals one rank, outputs and gradients.
#[test]
fn ring_layer_in_training_with_dropout_equals_one_rank() {
    let cfg = MultiheadConfig::new(16, 4, DilatedConfig::new(&[8, 16], &[1, 2]).unwrap()).with_dropout(0.3);
    for world in 2..=4 {
        for layout in [Layout::Contiguous, Layout::Zigzag] {
            check_mode(cfg.clone(), (world, layout, Strategy::Auto), 2, 37, Mode::Train { seed: 17 + world as u64 });
        }
    }
    let causal = MultiheadConfig::new(
        16,
        2,
        DilatedConfig::builder()
            .segments(&[8, 32])
            .dilations(&[1, 4])
            .mixing(Mixing::LongNet)
            .causal()
            .build()
            .unwrap(),
    )
    .with_dropout(0.5);
    check_mode(causal.clone(), (3, Layout::Zigzag, Strategy::Ring), 1, 45, Mode::Train { seed: 3 });
    check_mode(causal, (4, Layout::Contiguous, Strategy::AllGather), 1, 33, Mode::Train { seed: 4 });
}

#[test]
fn ring_encoder_stack_equals_one_rank_in_eval_and_training() {
    let (batch, seq, e, world) = (1, 36, 16, 3);
    let mut cfg = EncoderConfig::new(e, 4, DilatedConfig::new(&[8, 16], &[1, 2]).unwrap(), 24);
    cfg.dropout = 0.25;
    for mode in [Mode::Eval, Mode::Train { seed: 8 }] {
        check_encoder(cfg.clone(), batch, seq, e, world, mode);
    }
}

fn check_encoder(cfg: EncoderConfig, batch: usize, seq: usize, e: usize, world: usize, mode: Mode) {
    let single = LongNetEncoder::<f64>::new(cfg.clone(), 2, 5, Arc::new(ReferenceBackend)).unwrap();
    let x = random_vec(3, batch * seq * e);
    let g = random_vec(4, batch * seq * e);
    let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let g64: Vec<f64> = g.iter().map(|&v| v as f64).collect();
    let (y_want, cache) = single.forward_train(&x64, &Call::new(batch, seq).mode(mode)).unwrap();
    let mut gw = single.zero_grads();
    let dx_want = single.backward(&cache, &g64, &mut gw).unwrap();
    let comms = ThreadComm::world(world).unwrap();
    let results: Vec<(Vec<usize>, Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (cfg, x, g) = (cfg.clone(), &x, &g);
                s.spawn(move || {
                    let backend = Arc::new(RingBackend::new(comm, seq, Layout::Zigzag, Strategy::Auto).unwrap());
                    let pos = backend.positions();
                    let enc = LongNetEncoder::<f32>::new(cfg, 2, 5, backend).unwrap();
                    let (y, c) = enc
                        .forward_train(&gather(x, batch, seq, e, &pos), &Call::new(batch, pos.len()).mode(mode))
                        .unwrap();
                    let mut grads = enc.zero_grads();
                    let dx = enc.backward(&c, &gather(g, batch, seq, e, &pos), &mut grads).unwrap();
                    (pos, y, dx)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let (mut y, mut dx) = (vec![f32::NAN; x.len()], vec![f32::NAN; x.len()]);
    for (pos, yl, dxl) in &results {
        scatter(&mut y, yl, batch, seq, e, pos);
        scatter(&mut dx, dxl, batch, seq, e, pos);
    }
    let bound = Tolerance::for_dtype(DType::F32).rel_l2;
    assert!(rel_l2_error(&y, &y_want) <= bound, "{mode:?} out {:.2e}", rel_l2_error(&y, &y_want));
    assert!(rel_l2_error(&dx, &dx_want) <= bound, "{mode:?} dx {:.2e}", rel_l2_error(&dx, &dx_want));
}

/// Every rank's `(y, dx)` and all-reduced weight gradients with the backend's
/// `options` (`dx` empty and gradients zero without `backward`).
type RankRun = attn_core::Result<(Vec<f32>, Vec<f32>, MultiheadWeights<f32>)>;

fn run_ranks(cfg: &MultiheadConfig, world: usize, seq: usize, options: RingOptions, backward: bool) -> Vec<RankRun> {
    let (batch, e) = (1, cfg.embed_dim);
    let (x, g) = (random_vec(5, batch * seq * e), random_vec(6, batch * seq * e));
    let comms = ThreadComm::world(world).unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (cfg, x, g) = (cfg.clone(), &x, &g);
                s.spawn(move || -> RankRun {
                    let backend = RingBackend::new(comm, seq, Layout::Zigzag, Strategy::Ring)?.with_options(options);
                    let backend = Arc::new(backend);
                    let pos = backend.positions();
                    let layer = ring_layer(cfg.clone(), MultiheadWeights::<f32>::magneto(&cfg, 9), backend.clone())?;
                    let (y, c) = layer.forward_train(&gather(x, batch, seq, e, &pos), &Call::new(batch, pos.len()))?;
                    let mut grads = layer.weights.zeros_like();
                    if !backward {
                        return Ok((y, Vec::new(), grads));
                    }
                    let dx = layer.backward(&c, &gather(g, batch, seq, e, &pos), &mut grads)?.query;
                    backend.with_comm(|c| all_reduce_grads(c, &mut grads))?;
                    Ok((y, dx, grads))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// `RingBackend::with_options`: compute threads leave outputs and gradients bit for bit
/// unchanged; a memory budget is checked by the forward and by the backward (each
/// `OverBudget` on every rank when no rank can meet it).
#[test]
fn ring_layer_options_reach_the_ring() {
    let cfg = MultiheadConfig::new(
        32,
        4,
        DilatedConfig::builder()
            .segments(&[16, 64])
            .dilations(&[1, 2])
            .mixing(Mixing::LongNet)
            .causal()
            .build()
            .unwrap(),
    );
    let (world, seq) = (2, 64);
    let one = run_ranks(&cfg, world, seq, RingOptions::default(), true);
    let one: Vec<_> = one.into_iter().map(Result::unwrap).collect();
    assert!(one.iter().all(|(y, dx, _)| y.iter().any(|v| *v != 0.0) && dx.iter().any(|v| *v != 0.0)));
    for threads in [2, 5] {
        let got = run_ranks(&cfg, world, seq, RingOptions::default().with_threads(threads), true);
        for (a, b) in got.into_iter().map(Result::unwrap).zip(&one) {
            assert!(a.0 == b.0 && a.1 == b.1, "threads={threads}: y/dx differ");
            assert_eq!(a.2, b.2, "threads={threads}: weight gradients differ");
        }
    }
    let over = |r: &RankRun| matches!(r, Err(AttnError::OverBudget { .. }));
    let tiny = RingOptions::default().with_budget(MemoryBudget::bytes(64));
    assert!(run_ranks(&cfg, world, seq, tiny, false).iter().all(over), "the forward checks the budget");
    // Enough for the forward's workspace, not for the backward's.
    let shape = attn_core::Shape4::new(1, seq, cfg.num_heads, cfg.embed_dim / cfg.num_heads).unwrap();
    let problem = problem_for(&cfg.attention, shape, Layout::Zigzag, Strategy::Ring, world);
    let (fwd, bwd) = (
        ring_workspace_bytes(&problem, DType::F32, Pass::Forward),
        ring_workspace_bytes(&problem, DType::F32, Pass::Backward),
    );
    let (fwd, bwd) = (fwd.unwrap() as usize, bwd.unwrap() as usize);
    assert!(fwd < bwd, "{fwd} {bwd}");
    let between = RingOptions::default().with_budget(MemoryBudget::bytes(fwd));
    assert!(run_ranks(&cfg, world, seq, between, false).iter().all(Result::is_ok), "the forward fits");
    assert!(run_ranks(&cfg, world, seq, between, true).iter().all(over), "the backward checks the budget");
}
