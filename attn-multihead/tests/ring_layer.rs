//! The ring-parallel layer over 2 and 3 in-process ranks equals the single-rank layer: outputs, input and weight gradients.

use std::sync::Arc;

use attn_core::{DType, Mixing};
use attn_multihead::{
    Mode, MultiheadConfig, MultiheadDilatedAttention, MultiheadWeights, NamedParams, ReferenceBackend, RingBackend,
    all_reduce_grads, ring_layer,
};
use attn_ring::{Layout, Strategy, ThreadComm};
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

fn check(cfg: MultiheadConfig, world: usize, layout: Layout, strategy: Strategy, batch: usize, seq: usize) {
    let e = cfg.embed_dim;
    let single = MultiheadDilatedAttention::<f64>::new(cfg.clone(), 11, Arc::new(ReferenceBackend)).unwrap();
    let mut w32 = MultiheadWeights::<f32>::magneto(&cfg, 0);
    for (d, s) in w32.params_mut().into_iter().zip(single.weights.params()) {
        d.data.iter_mut().zip(s.data).for_each(|(a, &b)| *a = b as f32);
    }
    let x = random_vec(1, batch * seq * e);
    let g = random_vec(2, batch * seq * e);
    let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let g64: Vec<f64> = g.iter().map(|&v| v as f64).collect();
    let (y_want, cache) = single.forward_train(&x64, batch, seq, Mode::Eval).unwrap();
    let mut grads_want = single.weights.zeros_like();
    let dx_want = single.backward(&cache, &g64, &mut grads_want).unwrap().query;

    let comms = ThreadComm::world(world).unwrap();
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (cfg, w32, x, g) = (cfg.clone(), w32.clone(), &x, &g);
                s.spawn(move || {
                    let backend = Arc::new(RingBackend::new(comm, seq, layout, strategy).unwrap());
                    let pos = backend.positions().unwrap();
                    let layer = ring_layer(cfg, w32, backend.clone()).unwrap();
                    let xl = gather(x, batch, seq, e, &pos);
                    let (y, c) = layer.forward_train(&xl, batch, pos.len(), Mode::Eval).unwrap();
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
    let what = format!("p={world} {layout:?} {strategy:?}");
    assert!(rel_l2_error(&y, &y_want) <= bound, "{what} out {:.2e}", rel_l2_error(&y, &y_want));
    assert!(rel_l2_error(&dx, &dx_want) <= bound, "{what} dx {:.2e}", rel_l2_error(&dx, &dx_want));
    let first = &results[0].3;
    for (_, _, _, gr) in &results {
        assert_eq!(gr, first, "every rank holds the same reduced gradients");
    }
    for (got, want) in first.params().into_iter().zip(grads_want.params()) {
        if got.name == "k_proj.bias" {
            continue; // exactly zero in exact arithmetic; checked in cpu_backend.rs
        }
        let err = rel_l2_error(got.data, want.data);
        assert!(err <= bound, "{what} d {} {err:.2e}", got.name);
    }
}

#[test]
fn ring_layer_equals_one_rank_head_groups() {
    let cfg = MultiheadConfig::new(16, 4, &[8, 16], &[1, 2]);
    check(cfg.clone(), 2, Layout::Contiguous, Strategy::Auto, 2, 37);
    check(cfg, 3, Layout::Zigzag, Strategy::Ring, 1, 40);
}

#[test]
fn ring_layer_equals_one_rank_longnet_causal() {
    let cfg = MultiheadConfig::new(16, 2, &[8, 32], &[1, 4]).with_mixing(Mixing::LongNet).with_causal(true);
    check(cfg.clone(), 3, Layout::Contiguous, Strategy::AllGather, 1, 45);
    check(cfg, 2, Layout::Zigzag, Strategy::Auto, 1, 33);
}

#[test]
fn ring_encoder_stack_equals_one_rank() {
    use attn_multihead::{EncoderConfig, LongNetEncoder};
    let (batch, seq, e, world) = (1, 36, 16, 3);
    let cfg = EncoderConfig::new(e, 4, &[8, 16], &[1, 2], 24);
    let single = LongNetEncoder::<f64>::new(cfg.clone(), 2, 5, Arc::new(ReferenceBackend)).unwrap();
    let x = random_vec(3, batch * seq * e);
    let g = random_vec(4, batch * seq * e);
    let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let g64: Vec<f64> = g.iter().map(|&v| v as f64).collect();
    let (y_want, cache) = single.forward_train(&x64, batch, seq, Mode::Eval).unwrap();
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
                    let pos = backend.positions().unwrap();
                    let enc = LongNetEncoder::<f32>::new(cfg, 2, 5, backend).unwrap();
                    let (y, c) =
                        enc.forward_train(&gather(x, batch, seq, e, &pos), batch, pos.len(), Mode::Eval).unwrap();
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
    assert!(rel_l2_error(&y, &y_want) <= bound, "out {:.2e}", rel_l2_error(&y, &y_want));
    assert!(rel_l2_error(&dx, &dx_want) <= bound, "dx {:.2e}", rel_l2_error(&dx, &dx_want));
}
