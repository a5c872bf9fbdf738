//! Tensors that start off a 16-byte boundary (a view into a framework's buffer: a slice of
//! a fused projection, a narrowed head dim) on the CUDA path, through the CPU emulation of
//! the `.cu` kernels, which counts every misaligned vector access (a fault on a GPU): the
//! forward (direct and partial) and the backward give the same bits wherever q, k, v,
//! grad_out and the output start, under every kernel variant, and the plans do ask for
//! 16-byte loads where strides allow them, so the aligned runs take the vector path.
#![cfg(feature = "cuda")]

use attn_core::{DilatedConfig, Mixing, Shape4};
use attn_kernels::cuda::CudaElement;
use attn_kernels::cuda::ForwardPath;
use attn_kernels::cuda::emulation::{Emulator, HostAccs, HostArgs};
use attn_kernels::cuda::launch_plan::{BlockGeometry, plan_backward, plan_forward_direct};
use attn_kernels::cuda::plan::{
    BackwardDq, BackwardKeys, BackwardLoads, BackwardOptions, ForwardOptions, ForwardRows, ForwardStages, PatternFusion,
};
use attn_kernels::cuda::scratch::ScratchPool;
use attn_testkit::rng::random_vec;
use half::{bf16, f16};

use crate::cuda_emulation::{emulator, emulator_for};

/// A buffer holding `x` from element `skew` past a 16-byte boundary (`skew` elements of
/// `T` from an aligned address), and that start.
pub(crate) struct Placed<T> {
    buf: Vec<T>,
    start: usize,
}

impl<T: CudaElement> Placed<T> {
    pub(crate) fn new(x: &[f32], skew: usize) -> Self {
        let mut buf = vec![T::default(); x.len() + 16 + skew];
        let align = (0..16).find(|&i| (buf.as_ptr() as usize + i * size_of::<T>()).is_multiple_of(16));
        let start = align.expect("a 16-byte boundary within 16 elements") + skew;
        for (d, &v) in buf[start..].iter_mut().zip(x) {
            *d = T::from_f32(v);
        }
        Placed { buf, start }
    }

    pub(crate) fn view(&self) -> &[T] {
        &self.buf[self.start..]
    }

    fn view_mut(&mut self) -> &mut [T] {
        &mut self.buf[self.start..]
    }
}

/// Two patterns, one a head group; batch 2, so every stride counts.
fn config() -> DilatedConfig {
    DilatedConfig::builder().segments(&[16, 32]).dilations(&[1, 2]).mixing(Mixing::HeadGroups).build().unwrap()
}

fn geometry(cfg: &DilatedConfig, shape: Shape4) -> BlockGeometry<'_> {
    let s = shape.contiguous_strides();
    BlockGeometry {
        cfg,
        q: (shape, s),
        q_start: 0,
        k: (shape, s),
        v_strides: s,
        k_start: 0,
        g_strides: Some(s),
        band: cfg.band(),
        kpad_seq: None,
        block_mask: None,
        packing: None,
        window: None,
    }
}

/// out, lse, dq, dk and dv with q, k, v, grad_out and the output starting `skews`
/// elements past a 16-byte boundary.
fn run<T: CudaElement>(emu: &Emulator, path: ForwardPath, skews: [usize; 5]) -> [Vec<f32>; 5] {
    let cfg = config();
    let shape = Shape4::new(2, 40, 2, 64).unwrap();
    let g = geometry(&cfg, shape);
    let n = shape.numel();
    let [q, k, v, go] = [1, 2, 3, 4].map(|seed| random_vec(seed, n));
    let [q, k, v, go] =
        [(&q, skews[0]), (&k, skews[1]), (&v, skews[2]), (&go, skews[3])].map(|(x, s)| Placed::<T>::new(x, s));
    let mut out = Placed::<T>::new(&vec![0.0; n], skews[4]);
    let mut lse = vec![0.0f32; shape.lse_len()];
    let args =
        HostArgs { q: q.view(), k: k.view(), v: v.view(), g: None, lse: None, delta: None, kpad: None, bmask: None };
    emu.forward_call(&g, &args, path, (&mut out.view_mut()[..n], &mut lse), &mut ScratchPool::default()).unwrap();
    let delta = emu.delta(shape, &go.view()[..n], &out.view()[..n], None).unwrap();
    let args = HostArgs { g: Some(go.view()), lse: Some(&lse), delta: Some(&delta), ..args };
    let (mut dq, mut dk, mut dv) = (vec![0.0f32; n], vec![0.0f32; n], vec![0.0f32; n]);
    let acc = HostAccs { q_acc: &mut dq, lse: None, dk: Some(&mut dk), dv: Some(&mut dv) };
    emu.backward_block(&g, &args, acc).unwrap();
    let out = out.view()[..n].iter().map(|x| x.to_f32()).collect();
    [out, lse, dq, dk, dv]
}

fn same_bits_wherever_tensors_start<T: CudaElement>() {
    let cfg = config();
    let shape = Shape4::new(2, 40, 2, 64).unwrap();
    // The aligned runs ask for 16-byte loads of every tensor.
    let direct = plan_forward_direct(&geometry(&cfg, shape), T::DTYPE, T::SUFFIX, ForwardOptions::default()).unwrap();
    assert!(direct.is_some_and(|p| p.iter().all(|l| l.params.vec == 0b1111)), "direct forward without vector loads");
    let bwd = plan_backward(&geometry(&cfg, shape), T::DTYPE, T::SUFFIX, BackwardOptions::default()).unwrap();
    assert!(bwd.iter().all(|l| l.params.vec == 0b1111), "backward without vector loads");
    let check = |emu: &Emulator, what: &str, path: ForwardPath, all_skews: &[[usize; 5]]| {
        let want = run::<T>(emu, path, [0; 5]);
        for &skews in all_skews {
            let got = run::<T>(emu, path, skews);
            for (name, (g, w)) in ["out", "lse", "dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
                let same = g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
                let at = format!("tensors {skews:?} elements past a 16-byte boundary");
                assert!(same, "{} {what} {path:?}, {at}: {name} differs", T::SUFFIX);
            }
        }
    };
    // One tensor off its boundary at a time, then all of them (4 elements: 8 bytes).
    let one_by_one =
        [[4, 0, 0, 0, 0], [0, 4, 0, 0, 0], [0, 0, 4, 0, 0], [0, 0, 0, 4, 0], [0, 0, 0, 0, 4], [4, 2, 6, 4, 2]];
    for path in [ForwardPath::Direct, ForwardPath::Partial] {
        check(emulator(), "default kernels", path, &one_by_one);
    }
    // Every other block shape, pattern launch, K/V stages, query-tile load, keys a block
    // and dq sum.
    let (atomic, ordered) = (BackwardDq::Atomic, BackwardDq::Deterministic);
    let (two, three) = (ForwardStages::Two, ForwardStages::Three);
    let variants = [
        (ForwardRows::M128, PatternFusion::PerPattern, two, BackwardLoads::Pipelined, BackwardKeys::K64, atomic),
        (ForwardRows::M128W4, PatternFusion::PerPattern, two, BackwardLoads::Sync, BackwardKeys::K128, atomic),
        (ForwardRows::M64, PatternFusion::Fused, three, BackwardLoads::Pipelined, BackwardKeys::K128, atomic),
        (ForwardRows::M64, PatternFusion::PerPattern, two, BackwardLoads::Sync, BackwardKeys::K64, ordered),
        (ForwardRows::M128W4, PatternFusion::PerPattern, three, BackwardLoads::Pipelined, BackwardKeys::K128, ordered),
        (ForwardRows::M128, PatternFusion::PerPattern, three, BackwardLoads::Sync, BackwardKeys::K64, atomic),
    ];
    for (rows, fusion, stages, loads, keys, dq) in variants {
        let emu = emulator_for(
            ForwardOptions { rows, fusion, stages, ..ForwardOptions::default() },
            BackwardOptions { loads, keys, dq, ..BackwardOptions::default() },
        );
        let what =
            format!("rows {} {fusion:?} stages {}, backward {loads:?} {keys:?} {dq:?}", rows.name(), stages.name());
        check(emu, &what, ForwardPath::Direct, &[[4, 2, 6, 4, 2]]);
    }
}

#[test]
fn misaligned_views_give_the_aligned_bits_bf16() {
    same_bits_wherever_tensors_start::<bf16>();
}

#[test]
fn misaligned_views_give_the_aligned_bits_f16() {
    same_bits_wherever_tensors_start::<f16>();
}
