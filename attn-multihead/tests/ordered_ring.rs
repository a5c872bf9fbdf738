//! The Hilbert option on the ring: curve-ordered grids over 2–4 in-process ranks equal the single-device `OrderedAttention`.

use std::sync::Arc;

use attn_core::{AttnError, DType, DilatedConfig, Mixing};
use attn_hilbert::{Grid, OrderKind};
use attn_multihead::{
    Call, Cross, MultiheadConfig, MultiheadDilatedAttention, MultiheadWeights, NamedParams, OrderedAttention,
    OrderedRing, RankRows, ReferenceBackend, ring_layer,
};
use attn_ring::{Layout, RingBackend, Strategy, ThreadComm};
use attn_testkit::rng::random_vec;
use attn_testkit::tolerance::{Tolerance, rel_l2_error};

/// What one rank returns: whole output and input gradient, reduced weight gradients,
/// and its split-form output and input gradient with its tokens.
struct RankResult {
    y: Vec<f32>,
    dx: Vec<f32>,
    grads: MultiheadWeights<f32>,
    tokens: Vec<usize>,
    y_split: Vec<f32>,
    dx_split: Vec<f32>,
}

fn rows_of(whole: &[f32], batch: usize, n: usize, e: usize, tokens: &[usize]) -> Vec<f32> {
    (0..batch).flat_map(|b| tokens.iter().flat_map(move |&t| whole[(b * n + t) * e..][..e].iter().copied())).collect()
}

fn check(cfg: MultiheadConfig, grid: Grid, world: usize, layout: Layout, strategy: Strategy, batch: usize) {
    let (e, n) = (cfg.embed_dim, grid.len());
    let layer = MultiheadDilatedAttention::<f64>::new(cfg.clone(), 11, Arc::new(ReferenceBackend)).unwrap();
    let single = OrderedAttention::new(layer, OrderKind::Hilbert, grid).unwrap();
    let mut w32 = MultiheadWeights::<f32>::magneto(&cfg, 0);
    for (d, s) in w32.params_mut().into_iter().zip(single.layer.weights.params()) {
        d.data.iter_mut().zip(s.data).for_each(|(a, &b)| *a = b as f32);
    }
    let x = random_vec(1, batch * n * e);
    let g = random_vec(2, batch * n * e);
    let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let g64: Vec<f64> = g.iter().map(|&v| v as f64).collect();
    let (y_want, cache) = single.forward_train(&x64, &Call::new(batch, n)).unwrap();
    let mut grads_want = single.layer.weights.zeros_like();
    let dx_want = single.backward(&cache, &g64, &mut grads_want).unwrap().query;

    let comms = ThreadComm::world(world).unwrap();
    let results: Vec<RankResult> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (cfg, w32, x, g) = (cfg.clone(), w32.clone(), &x, &g);
                s.spawn(move || {
                    let ring = OrderedRing::new(cfg, w32, OrderKind::Hilbert, grid, comm, layout, strategy).unwrap();
                    let (y, c) = ring.forward_train(x, &Call::new(batch, n)).unwrap();
                    let mut grads = ring.layer.weights.zeros_like();
                    let dx = ring.backward(&c, g, &mut grads).unwrap();
                    ring.all_reduce_grads(&mut grads).unwrap();
                    // The split form: this rank's rows only, ascending row-major tokens.
                    let (xs, gs) = (ring.split(x, batch).unwrap(), ring.split(g, batch).unwrap());
                    let (y_split, c) =
                        ring.forward_train(&xs, &Call::new(batch, ring.tokens().len()).rows(RankRows::Split)).unwrap();
                    let mut unused = ring.layer.weights.zeros_like();
                    let dx_split = ring.backward(&c, &gs, &mut unused).unwrap();
                    RankResult { y, dx, grads, tokens: ring.tokens().to_vec(), y_split, dx_split }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let bound = Tolerance::for_dtype(DType::F32).rel_l2;
    let what = format!("{:?} p={world} {layout:?} {strategy:?}", grid.dims());
    let first = &results[0];
    let (ey, edx) = (rel_l2_error(&first.y, &y_want), rel_l2_error(&first.dx, &dx_want));
    eprintln!("{what}: rel L2 out {ey:.1e}, dx {edx:.1e} (bound {bound:.0e})");
    assert!(ey <= bound, "{what} out {ey:.2e}");
    assert!(edx <= bound, "{what} dx {edx:.2e}");
    for (got, want) in first.grads.params().into_iter().zip(grads_want.params()) {
        if got.name == "k_proj.bias" {
            continue; // exactly zero in exact arithmetic; checked in cpu_backend.rs
        }
        let err = rel_l2_error(got.data, want.data);
        assert!(err <= bound, "{what} d {} {err:.2e}", got.name);
    }
    let mut owners = vec![0usize; n];
    for r in &results {
        assert_eq!((&r.y, &r.dx, &r.grads), (&first.y, &first.dx, &first.grads), "{what}: ranks agree bit for bit");
        // The split form runs the same chunk: its rows are exactly the whole result's rows.
        assert_eq!(r.y_split, rows_of(&first.y, batch, n, e, &r.tokens), "{what} split out");
        assert_eq!(r.dx_split, rows_of(&first.dx, batch, n, e, &r.tokens), "{what} split dx");
        r.tokens.iter().for_each(|&t| owners[t] += 1);
    }
    assert!(owners.iter().all(|&c| c == 1), "{what}: every token has exactly one rank");
}

#[test]
fn hilbert_ring_on_a_6x10_grid_equals_one_device() {
    let cfg = MultiheadConfig::new(16, 4, DilatedConfig::new(&[8, 16], &[1, 2]).unwrap());
    let grid = Grid::new_2d(6, 10).unwrap();
    check(cfg.clone(), grid, 2, Layout::Contiguous, Strategy::Auto, 2);
    check(cfg.clone(), grid, 3, Layout::Contiguous, Strategy::Ring, 1);
    check(cfg, grid, 4, Layout::Zigzag, Strategy::AllGather, 1);
}

#[test]
fn hilbert_ring_on_a_3d_grid_equals_one_device_longnet_causal() {
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
    let grid = Grid::new_3d(3, 4, 5).unwrap();
    check(cfg.clone(), grid, 4, Layout::Contiguous, Strategy::Auto, 1);
    check(cfg, grid, 2, Layout::Zigzag, Strategy::Ring, 2);
}

/// Sides of the grid bounding box of `tokens` (depth, height, width).
fn bounding_box(grid: Grid, tokens: &[usize]) -> [usize; 3] {
    std::array::from_fn(|d| {
        let c = tokens.iter().map(|&t| grid.coords_of(t)[d]);
        c.clone().max().unwrap() - c.min().unwrap() + 1
    })
}

/// Each rank's tokens under `kind` order, contiguous layout.
fn rank_tokens(kind: OrderKind, grid: Grid, world: usize) -> Vec<Vec<usize>> {
    let cfg = MultiheadConfig::new(8, 2, DilatedConfig::new(&[4, 8], &[1, 2]).unwrap());
    ThreadComm::world(world)
        .unwrap()
        .into_iter()
        .map(|comm| {
            let w = MultiheadWeights::<f32>::magneto(&cfg, 0);
            let ring = OrderedRing::new(cfg.clone(), w, kind, grid, comm, Layout::Contiguous, Strategy::Auto).unwrap();
            ring.tokens().to_vec()
        })
        .collect()
}

#[test]
fn each_rank_gets_a_compact_patch() {
    for (grid, world) in [
        (Grid::new_2d(6, 10).unwrap(), 4),
        (Grid::new_2d(16, 16).unwrap(), 4),
        (Grid::new_2d(12, 20).unwrap(), 8),
        (Grid::new_3d(4, 6, 8).unwrap(), 4),
    ] {
        let hil = rank_tokens(OrderKind::Hilbert, grid, world);
        let rm = rank_tokens(OrderKind::RowMajor, grid, world);
        let boxes = |t: &[Vec<usize>]| -> Vec<[usize; 3]> { t.iter().map(|t| bounding_box(grid, t)).collect() };
        let (bh, br) = (boxes(&hil), boxes(&rm));
        eprintln!("{:?} p={world}: bounding boxes hilbert {bh:?}, row-major {br:?}", grid.dims());
        // Every Hilbert chunk's longest side is shorter than every row-major chunk's,
        // and its half-perimeter is smaller too: a compact patch, not a strip of rows.
        let longest = |b: &[usize; 3]| *b.iter().max().unwrap();
        let half_perimeter = |b: &[usize; 3]| b.iter().sum::<usize>();
        let hil_longest = bh.iter().map(longest).max().unwrap();
        assert!(br.iter().all(|b| longest(b) > hil_longest), "{:?}: {bh:?} vs {br:?}", grid.dims());
        for (h, r) in bh.iter().zip(&br) {
            assert!(half_perimeter(h) < half_perimeter(r), "{:?}: {bh:?} vs {br:?}", grid.dims());
        }
    }
}

#[test]
fn bad_sizes_are_errors_not_panics() {
    let cfg = MultiheadConfig::new(8, 2, DilatedConfig::new(&[4, 8], &[1, 2]).unwrap());
    let w = || MultiheadWeights::<f32>::magneto(&cfg, 0);
    let grid = Grid::new_2d(2, 3).unwrap();
    // 6 tokens cannot give each of 7 ranks a row.
    let comm = ThreadComm::world(7).unwrap().into_iter().next().unwrap();
    assert!(
        OrderedRing::new(cfg.clone(), w(), OrderKind::Hilbert, grid, comm, Layout::Contiguous, Strategy::Auto).is_err()
    );
    let comm = ThreadComm::world(1).unwrap().into_iter().next().unwrap();
    let ring =
        OrderedRing::new(cfg.clone(), w(), OrderKind::Hilbert, grid, comm, Layout::Zigzag, Strategy::Auto).unwrap();
    let x = random_vec(3, 6 * 8);
    assert!(ring.forward(&x[..40], &Call::new(1, 6)).is_err(), "whole tensor of the wrong length");
    assert!(ring.forward(&x, &Call::new(0, 6)).is_err(), "batch 0");
    assert!(ring.split(&x, 2).is_err(), "batch does not match the length");
    assert!(ring.forward(&x[..8], &Call::new(1, 6).rows(RankRows::Split)).is_err(), "split rows of the wrong count");
    assert!(ring.forward(&x[..40], &Call::new(1, 5)).is_err(), "a call's seq other than the grid's tokens");
    let kv = random_vec(4, 6 * 8);
    let cross = Call::new(1, 6).cross(Cross::new(&kv, &kv, 6));
    assert!(
        matches!(ring.forward(&x, &cross), Err(AttnError::Unsupported { backend: "OrderedRing", .. })),
        "cross-attention on the ordered ring"
    );
    // One rank: the whole and split forms are the single-device order on the same weights.
    let single = OrderedAttention::new(ring.layer.clone(), OrderKind::Hilbert, grid).unwrap();
    let want = single.forward(&x, &Call::new(1, 6)).unwrap();
    assert!(rel_l2_error(&ring.forward(&x, &Call::new(1, 6)).unwrap(), &want) <= 1e-6);
    assert_eq!(ring.tokens(), &[0, 1, 2, 3, 4, 5]);
}

#[test]
fn the_ring_option_is_reachable_from_the_layer() {
    let cfg = MultiheadConfig::new(16, 4, DilatedConfig::new(&[8, 16], &[1, 2]).unwrap());
    let (grid, world, batch) = (Grid::new_2d(6, 10).unwrap(), 3, 2);
    let (e, n) = (cfg.embed_dim, grid.len());
    let w = MultiheadWeights::<f32>::magneto(&cfg, 5);
    let single = MultiheadDilatedAttention::from_weights(cfg.clone(), w.clone(), Arc::new(ReferenceBackend))
        .unwrap()
        .with_token_order(grid, OrderKind::Hilbert)
        .unwrap();
    let x = random_vec(4, batch * n * e);
    let want = single.forward(&x, &Call::new(batch, n)).unwrap();
    let outs: Vec<(Vec<f32>, Vec<usize>)> = std::thread::scope(|s| {
        let handles: Vec<_> = ThreadComm::world(world)
            .unwrap()
            .into_iter()
            .map(|comm| {
                let (cfg, w, x) = (cfg.clone(), w.clone(), &x);
                s.spawn(move || {
                    let backend = Arc::new(RingBackend::new(comm, n, Layout::Contiguous, Strategy::Auto).unwrap());
                    // A layer built on another backend is rebound to the ring's.
                    let layer = MultiheadDilatedAttention::from_weights(cfg, w, Arc::new(ReferenceBackend)).unwrap();
                    let ring = layer.with_ring_token_order(backend, grid, OrderKind::Hilbert).unwrap();
                    assert_eq!(ring.layer.backend().name(), "ring");
                    (ring.forward(x, &Call::new(batch, grid.len())).unwrap(), ring.tokens().to_vec())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let bound = Tolerance::for_dtype(DType::F32).rel_l2;
    let tokens = rank_tokens(OrderKind::Hilbert, grid, world);
    for (r, (y, t)) in outs.iter().enumerate() {
        assert!(rel_l2_error(y, &want) <= bound, "rank {r}");
        assert_eq!(t, &tokens[r], "same patches as OrderedRing::new");
    }
    // The backend's global sequence must be the grid.
    let comm = ThreadComm::world(1).unwrap().into_iter().next().unwrap();
    let backend = Arc::new(RingBackend::new(comm, n + 1, Layout::Contiguous, Strategy::Auto).unwrap());
    let layer = ring_layer(cfg, w, backend.clone()).unwrap();
    assert!(matches!(
        layer.with_ring_token_order(backend, grid, OrderKind::Hilbert),
        Err(attn_core::AttnError::InvalidArgument(_))
    ));
}
