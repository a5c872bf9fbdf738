//! A block over a window of a problem's heads (`HeadWindow`, a Ulysses slot) on the CUDA
//! path without a GPU (the CPU emulation of the `.cu` kernels): the window's out, lse and
//! gradients equal the same heads cut from the call over every head, for head-group and
//! LongNet mixing (whose patterns follow the global head), a per-head block mask (whose
//! rows follow it) and grouped key/value heads read from a run that starts past head 0, on
//! the row kernels (f32) and the tensor-core kernels (bf16).
#![cfg(feature = "cuda")]

use std::ops::Range;

use attn_core::{AttnError, BlockDims, BlockMaskBuf, Causality, DilatedConfig, Mixing, Shape4};
use attn_kernels::cuda::CudaElement;
use attn_kernels::cuda::emulation::{HostAccs, HostArgs};
use attn_kernels::cuda::launch_plan::{BlockGeometry, BlockMaskShape};
use attn_kernels::cuda::plan::head_window::HeadWindow;
use attn_testkit::rng::random_vec;
use attn_testkit::tolerance::rel_l2_error;
use half::bf16;

use crate::cuda_emulation::emulator;

const HEADS: usize = 8;
const KV_HEADS: usize = 4;
const SEQ: usize = 40;
const D: usize = 16;

/// Heads `r` of every row of `[rows, heads, width]` values.
fn cut<X: Copy>(x: &[X], heads: usize, width: usize, r: &Range<usize>) -> Vec<X> {
    x.chunks_exact(heads * width).flat_map(|row| &row[r.start * width..r.end * width]).copied().collect()
}

/// A batch-1 block of `q_heads` over `kv_heads` heads, every position, under `window`.
fn geometry<'a>(
    cfg: &'a DilatedConfig,
    (q_heads, kv_heads): (usize, usize),
    mask: Option<&BlockMaskBuf>,
    window: Option<HeadWindow>,
) -> BlockGeometry<'a> {
    let (sq, sk) = (Shape4::new(1, SEQ, q_heads, D).unwrap(), Shape4::new(1, SEQ, kv_heads, D).unwrap());
    BlockGeometry {
        cfg,
        q: (sq, sq.contiguous_strides()),
        q_start: 0,
        k: (sk, sk.contiguous_strides()),
        v_strides: sk.contiguous_strides(),
        k_start: 0,
        g_strides: Some(sq.contiguous_strides()),
        band: cfg.band(),
        kpad_seq: None,
        packing: None,
        block_mask: mask.map(|m| BlockMaskShape::from(m.view())),
        window,
    }
}

/// Forward (out partial and lse) and backward (dq, dk, dv given `lse` and `delta`) of one
/// block of `q`, `k`, `v`, `go` (heads as `g` says).
struct Run<'a, T> {
    g: BlockGeometry<'a>,
    qkv: [&'a [T]; 3],
    go: &'a [T],
    bmask: Option<&'a [u8]>,
}

impl<T: CudaElement> Run<'_, T> {
    fn forward(&self) -> Result<(Vec<f32>, Vec<f32>), AttnError> {
        let (qs, mut g) = (self.g.q.0, self.g);
        g.g_strides = None;
        let (mut out, mut lse) = (vec![0.0f32; qs.numel()], vec![f32::NEG_INFINITY; qs.lse_len()]);
        let [q, k, v] = self.qkv;
        let args = HostArgs { q, k, v, g: None, lse: None, delta: None, kpad: None, bmask: self.bmask };
        let acc = HostAccs { q_acc: &mut out, lse: Some(&mut lse), dk: None, dv: None };
        emulator().forward_block(&g, &args, acc)?;
        Ok((out, lse))
    }

    fn backward(&self, lse: &[f32], delta: &[f32]) -> [Vec<f32>; 3] {
        let (qs, ks) = (self.g.q.0, self.g.k.0);
        let (mut dq, mut dk, mut dv) = (vec![0.0f32; qs.numel()], vec![0.0f32; ks.numel()], vec![0.0f32; ks.numel()]);
        let [q, k, v] = self.qkv;
        let (lse, delta) = (Some(lse), Some(delta));
        let args = HostArgs { q, k, v, g: Some(self.go), lse, delta, kpad: None, bmask: self.bmask };
        let acc = HostAccs { q_acc: &mut dq, lse: None, dk: Some(&mut dk), dv: Some(&mut dv) };
        emulator().backward_block(&self.g, &args, acc).unwrap();
        [dq, dk, dv]
    }
}

/// `got` equals `want` value for value (NaN-free): else the count of values that differ and
/// the first of them.
fn same(name: &str, got: &[f32], want: &[f32], at: &str) {
    let diff: Vec<usize> = (0..want.len()).filter(|&i| got.get(i) != Some(&want[i])).collect();
    if let (Some(&i), true) = (diff.first(), got.len() == want.len()) {
        panic!("{name}: {} of {} values differ, first [{i}] {} != {}: {at}", diff.len(), want.len(), got[i], want[i]);
    }
    assert_eq!(got.len(), want.len(), "{name}: {at}");
}

/// The window `(first, n, kv_first, m)` of `cfg` (under `mask`) against the whole call.
fn window_equals_the_cut<T: CudaElement>(cfg: &DilatedConfig, mask: Option<&BlockMaskBuf>, w: [usize; 4]) {
    let [first, n, kv_first, m] = w;
    let (heads, kv) = (first..first + n, kv_first..kv_first + m);
    let at = format!(
        "{:?} {:?} mask {} heads {heads:?} kv {kv:?} {}",
        cfg.mixing(),
        cfg.causality(),
        mask.is_some(),
        T::SUFFIX
    );
    let elems = |seed, heads| random_vec(seed, SEQ * heads * D).into_iter().map(T::from_f32).collect::<Vec<T>>();
    let (q, k, v) = (elems(31, HEADS), elems(32, KV_HEADS), elems(33, KV_HEADS));
    // grad_out of the heads outside the window zero, so the whole call's dk/dv are the window's.
    let inside = |i: usize| heads.contains(&(i % HEADS));
    let go: Vec<T> = elems(34, HEADS)
        .chunks_exact(D)
        .enumerate()
        .flat_map(|(i, row)| row.iter().map(move |&x| if inside(i) { x } else { T::from_f32(0.0) }))
        .collect();
    let keep = mask.map(|m| m.view().keep());
    let whole = Run { g: geometry(cfg, (HEADS, KV_HEADS), mask, None), qkv: [&q, &k, &v], go: &go, bmask: keep };
    let (wq, wk, wv, wgo) =
        (cut(&q, HEADS, D, &heads), cut(&k, KV_HEADS, D, &kv), cut(&v, KV_HEADS, D, &kv), cut(&go, HEADS, D, &heads));
    let window = HeadWindow { heads: HEADS, kv_heads: KV_HEADS, first, kv_first };
    let part = Run { g: geometry(cfg, (n, m), mask, Some(window)), qkv: [&wq, &wk, &wv], go: &wgo, bmask: keep };
    let (out, lse) = whole.forward().unwrap();
    let (wout, wlse) = part.forward().unwrap();
    same("out", &wout, &cut(&out, HEADS, D, &heads), &at);
    same("lse", &wlse, &cut(&lse, HEADS, 1, &heads), &at);
    // Any delta serves the comparison; zero outside the window, as grad_out.
    let delta: Vec<f32> =
        (0..SEQ * HEADS).map(|i| if heads.contains(&(i % HEADS)) { 0.01 * (i % 7) as f32 } else { 0.0 }).collect();
    let [dq, dk, dv] = whole.backward(&lse, &delta);
    let [wdq, wdk, wdv] = part.backward(&wlse, &cut(&delta, HEADS, 1, &heads));
    same("dq", &wdq, &cut(&dq, HEADS, D, &heads), &at);
    for (name, (got, all)) in [("dk", (&wdk, &dk)), ("dv", (&wdv, &dv))] {
        let want = cut(all, KV_HEADS, D, &kv);
        assert!(want.iter().any(|&x| x != 0.0), "{name}: all zero: {at}");
        let e = rel_l2_error(got, &want);
        assert!(e < 1e-6, "{name} {e:.2e}: {at}");
    }
}

/// Head groups (two groups of four: the windows straddle them), LongNet with rates 1 and 3
/// (each head's offset is its global index mod 3), and head groups under a mask that
/// differs per head; windows of heads 2..6 (key/value heads 0..4 held, 1..3 read) and 3..6
/// (key/value heads 1..3: the first held is 1).
fn windows_equal_the_cut<T: CudaElement>() {
    let hg = DilatedConfig::builder().segments(&[8, 20]).dilations(&[1, 2]).build().unwrap();
    let longnet = DilatedConfig::builder()
        .segments(&[8, 40])
        .dilations(&[1, 3])
        .mixing(Mixing::LongNet)
        .causality(Causality::Causal)
        .build()
        .unwrap();
    let masked =
        DilatedConfig::builder().segments(&[8, 40]).dilations(&[1, 2]).causality(Causality::Causal).build().unwrap();
    let dims = BlockDims { batch: 1, heads: HEADS, q_blocks: 8, k_blocks: 8 };
    let mask = BlockMaskBuf::from_fn(dims, 5, |_, h, i, j| i == j || (i * 3 + j + h) % 3 == 1).unwrap();
    for (cfg, mask) in [(&hg, None), (&longnet, None), (&masked, Some(&mask))] {
        for w in [[2, 4, 0, 4], [3, 3, 1, 2]] {
            window_equals_the_cut::<T>(cfg, mask, w);
        }
    }
}

#[test]
fn a_head_window_equals_its_heads_of_the_whole_call_on_the_row_kernels() {
    windows_equal_the_cut::<f32>();
}

#[test]
fn a_head_window_equals_its_heads_of_the_whole_call_on_tensor_cores() {
    windows_equal_the_cut::<bf16>();
}

/// A window past the problem's heads, or whose key/value heads miss one its query heads
/// read, is a typed error before any launch.
#[test]
fn a_window_that_does_not_fit_is_a_typed_error() {
    let cfg = DilatedConfig::new(&[8, 20], &[1, 2]).unwrap();
    let x = vec![0.5f32; SEQ * 4 * D];
    for (window, kv_heads, want) in [
        (HeadWindow { heads: HEADS, kv_heads: KV_HEADS, first: 6, kv_first: 3 }, 1, "outside"),
        (HeadWindow { heads: HEADS, kv_heads: KV_HEADS, first: 2, kv_first: 2 }, 2, "do not hold"),
    ] {
        let run = Run { g: geometry(&cfg, (4, kv_heads), None, Some(window)), qkv: [&x, &x, &x], go: &x, bmask: None };
        let e = run.forward().unwrap_err();
        assert!(matches!(e, AttnError::InvalidArgument(_)) && e.to_string().contains(want), "{e}");
    }
}
