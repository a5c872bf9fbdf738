//! The CUDA path without a GPU: the whole-call backend on the CPU emulation of the `.cu`
//! kernels (`cuda::emulation`) through this crate's launch plans (`cuda::launch_plan`) and
//! epilogue launches, shared by the other `cuda_*` test modules, and every golden file of
//! `conformance/dilated`, `conformance/features` and `conformance/wide` (cross-attention,
//! explicit scales, head_dim 64 and 128) through it in f32, bf16 and f16, forward and
//! gradients. `cuda_emulation_paths` compares kernel shapes bit for bit,
//! `cuda_emulation_cases` judges targeted cases against the float64 reference. Needs a
//! C++20 compiler (`$CXX`, default `g++`); without one the test fails, naming it.
#![cfg(feature = "cuda")]

use std::marker::PhantomData;
use std::path::Path;
use std::sync::{Mutex, OnceLock};

use attn_core::{DType, Result};
use attn_kernels::cuda::CudaElement;
use attn_kernels::cuda::ForwardPath;
use attn_kernels::cuda::emulation::{Emulator, HostAccs, HostArgs};
use attn_kernels::cuda::launch_plan::{BlockGeometry, BlockMaskShape, plan_forward_direct};
use attn_kernels::cuda::plan::{
    BackwardDq, BackwardKeys, BackwardLoads, BackwardMma, BackwardOptions, BackwardQueries, BackwardWrites, ForwardMma,
    ForwardOptions, ForwardRows, ForwardStages, PatternFusion,
};
use attn_kernels::cuda::scratch::ScratchPool;
use attn_testkit::golden::{DilatedBackend, Forward32, Gradients32, Problem, assert_attention_dirs_pass};
use half::{bf16, f16};

pub(crate) fn emulator() -> &'static Emulator {
    Emulator::shared(Path::new(env!("CARGO_TARGET_TMPDIR")))
        .unwrap_or_else(|e| panic!("the CUDA kernel emulation needs a C++20 compiler ($CXX or g++): {e}"))
}

/// A fresh emulator of the shared library (default options, grid order), for tests that set
/// their own options and block order.
pub(crate) fn fresh_emulator() -> Emulator {
    emulator();
    Emulator::load(&Emulator::library_path(Path::new(env!("CARGO_TARGET_TMPDIR")))).unwrap()
}

/// The emulator planning the forward with `opts` and the backward with `bwd` (the shared
/// library, loaded again, whatever `ATTN_CUDA_FWD_*` and `ATTN_CUDA_BWD_*` say).
pub(crate) fn emulator_for(opts: ForwardOptions, bwd: BackwardOptions) -> &'static Emulator {
    const N: usize = ForwardRows::ALL.len() * PatternFusion::ALL.len();
    static EMULATORS: [OnceLock<Emulator>; 256 * N] = [const { OnceLock::new() }; 256 * N];
    let rows = ForwardRows::ALL.iter().position(|&r| r == opts.rows).unwrap_or(0);
    let fusion = PatternFusion::ALL.iter().position(|&f| f == opts.fusion).unwrap_or(0);
    let slot = rows
        + ForwardRows::ALL.len() * fusion
        + N * usize::from(bwd.loads == BackwardLoads::Pipelined)
        + 2 * N * usize::from(bwd.keys == BackwardKeys::K128)
        + 4 * N * usize::from(bwd.dq == BackwardDq::Deterministic)
        + 8 * N * usize::from(opts.stages == ForwardStages::Three)
        + 16 * N * usize::from(bwd.writes == BackwardWrites::Direct)
        + 32 * N * usize::from(bwd.queries == BackwardQueries::Q64)
        + 64 * N * usize::from(opts.mma == ForwardMma::Wgmma)
        + 128 * N * usize::from(bwd.mma == BackwardMma::Wgmma);
    EMULATORS[slot].get_or_init(|| {
        emulator();
        let lib = Emulator::library_path(Path::new(env!("CARGO_TARGET_TMPDIR")));
        Emulator::load(&lib)
            .unwrap()
            .with_forward_rows(opts.rows)
            .with_pattern_fusion(opts.fusion)
            .with_forward_stages(opts.stages)
            .with_forward_mma(opts.mma)
            .with_backward_loads(bwd.loads)
            .with_backward_keys(bwd.keys)
            .with_backward_dq(bwd.dq)
            .with_backward_writes(bwd.writes)
            .with_backward_queries(bwd.queries)
            .with_backward_mma(bwd.mma)
    })
}

/// The emulator with the forward's `opts` and the default backward.
pub(crate) fn emulator_with(opts: ForwardOptions) -> &'static Emulator {
    emulator_for(opts, BackwardOptions::default())
}

/// The emulator with the default forward and the backward's query-tile `loads`.
pub(crate) fn emulator_loading(loads: BackwardLoads) -> &'static Emulator {
    emulator_for(ForwardOptions::default(), BackwardOptions { loads, ..BackwardOptions::default() })
}

/// The whole-sequence CUDA call (`CudaBackend`'s steps) on the emulation, in `T`, the
/// forward's tensor-core blocks planned with `opts`.
pub(crate) struct Emulated<T> {
    opts: ForwardOptions,
    bwd: BackwardOptions,
    dtype: PhantomData<T>,
    /// The scratch the whole calls reuse, as a device's stream keeps it.
    pool: Mutex<ScratchPool<Vec<f32>>>,
}

impl<T> Emulated<T> {
    pub(crate) fn new(rows: ForwardRows) -> Self {
        let opts = ForwardOptions { rows, ..ForwardOptions::default() };
        Emulated { opts, bwd: BackwardOptions::default(), dtype: PhantomData, pool: Mutex::default() }
    }

    pub(crate) fn fused(rows: ForwardRows) -> Self {
        Self::new(rows).with_fusion(PatternFusion::Fused)
    }

    /// The same backend, the forward's patterns launched as `fusion` says.
    pub(crate) fn with_fusion(self, fusion: PatternFusion) -> Self {
        Emulated { opts: ForwardOptions { fusion, ..self.opts }, ..self }
    }

    /// The same backend, the forward with `stages` K/V stages.
    pub(crate) fn with_stages(self, stages: ForwardStages) -> Self {
        Emulated { opts: ForwardOptions { stages, ..self.opts }, ..self }
    }

    /// The same backend, the f16/bf16 forward's instructions as `mma` says (`Wgmma`: an
    /// emulated sm_90a device).
    pub(crate) fn with_mma(self, mma: ForwardMma) -> Self {
        Emulated { opts: ForwardOptions { mma, ..self.opts }, ..self }
    }

    /// The forward's options.
    pub(crate) fn options(&self) -> ForwardOptions {
        self.opts
    }

    /// The same forward, the backward planned with `bwd`.
    pub(crate) fn with_backward(self, bwd: BackwardOptions) -> Self {
        Emulated { bwd, ..self }
    }
}

/// The geometry of a whole call whose output is contiguous.
pub(crate) fn call_geometry<'a>(p: &Problem<'a>) -> BlockGeometry<'a> {
    geometry(p, Some(p.shape.q.contiguous_strides()))
}

pub(crate) fn conv<T: CudaElement>(x: &[f32]) -> Vec<T> {
    x.iter().map(|&v| T::from_f32(v)).collect()
}

pub(crate) fn geometry<'a>(p: &Problem<'a>, g_strides: Option<[usize; 4]>) -> BlockGeometry<'a> {
    let (sq, skv) = (p.shape.q, p.shape.kv);
    BlockGeometry {
        cfg: p.cfg,
        q: (sq, sq.contiguous_strides()),
        q_start: 0,
        k: (skv, skv.contiguous_strides()),
        v_strides: skv.contiguous_strides(),
        k_start: 0,
        g_strides,
        band: p.cfg.band(),
        kpad_seq: p.masks.key_padding.map(|m| m.seq()),
        packing: p.masks.packing,
        block_mask: p.masks.block.map(BlockMaskShape::from),
        window: None,
    }
}

/// The block mask's entries, where the problem has one.
pub(crate) fn block_keep<'a>(p: &Problem<'a>) -> Option<&'a [u8]> {
    p.masks.block.map(|m| m.keep())
}

pub(crate) fn flags(p: &Problem<'_>) -> Option<Vec<u8>> {
    p.masks.key_padding.map(|m| m.flags().iter().map(|&f| u8::from(f)).collect())
}

impl<T: CudaElement> Emulated<T> {
    /// out (in `T`) and lse.
    pub(crate) fn run_forward(&self, p: &Problem<'_>, q: &[T], k: &[T], v: &[T]) -> Result<(Vec<T>, Vec<f32>)> {
        self.forward_on(p, [q, k, v], ForwardPath::Direct)
    }

    /// The whole-call forward on `path`: out (in `T`) and lse.
    pub(crate) fn forward_on(&self, p: &Problem<'_>, qkv: [&[T]; 3], path: ForwardPath) -> Result<(Vec<T>, Vec<f32>)> {
        self.forward_with(emulator_with(self.opts), p, qkv, path)
    }

    /// [`Self::forward_on`] on `emu` (its own options and block order), the scratch from
    /// this backend's pool.
    pub(crate) fn forward_with(
        &self,
        emu: &Emulator,
        p: &Problem<'_>,
        [q, k, v]: [&[T]; 3],
        path: ForwardPath,
    ) -> Result<(Vec<T>, Vec<f32>)> {
        let sq = p.shape.q;
        let kpad = flags(p);
        let args = HostArgs { q, k, v, g: None, lse: None, delta: None, kpad: kpad.as_deref(), bmask: block_keep(p) };
        let (mut out, mut lse) = (vec![T::default(); sq.numel()], vec![0.0f32; sq.lse_len()]);
        let mut pool = self.pool.lock().unwrap();
        emu.forward_call(&call_geometry(p), &args, path, (&mut out, &mut lse), &mut pool)?;
        Ok((out, lse))
    }

    /// The backward's f32 accumulators dq, dk, dv on `emu` (inputs rounded to `T`).
    pub(crate) fn backward_accs(
        &self,
        emu: &Emulator,
        p: &Problem<'_>,
        [q, k, v]: [&[f32]; 3],
        grad_out: &[f32],
        grad_lse: Option<&[f32]>,
    ) -> Result<[Vec<f32>; 3]> {
        let (sq, skv) = (p.shape.q, p.shape.kv);
        let (q, k, v, go): (Vec<T>, Vec<T>, Vec<T>, Vec<T>) = (conv(q), conv(k), conv(v), conv(grad_out));
        let (out, lse) = self.run_forward(p, &q, &k, &v)?;
        let delta = emu.delta(sq, &go, &out, grad_lse.map(|g| (g, &lse[..])))?;
        let kpad = flags(p);
        let args = HostArgs {
            q: &q,
            k: &k,
            v: &v,
            g: Some(&go),
            lse: Some(&lse),
            delta: Some(&delta),
            kpad: kpad.as_deref(),
            bmask: block_keep(p),
        };
        let (mut dq, mut dk, mut dv) = (vec![0.0f32; sq.numel()], vec![0.0f32; skv.numel()], vec![0.0f32; skv.numel()]);
        let acc = HostAccs { q_acc: &mut dq, lse: None, dk: Some(&mut dk), dv: Some(&mut dv) };
        emu.backward_block(&geometry(p, Some(sq.contiguous_strides())), &args, acc)?;
        Ok([dq, dk, dv])
    }

    /// Whether the direct path applies to `p` (one pattern per head, the tensor-core kernel).
    pub(crate) fn direct_applies(&self, p: &Problem<'_>) -> bool {
        plan_forward_direct(&call_geometry(p), T::DTYPE, T::SUFFIX, self.opts).is_ok_and(|x| x.is_some())
    }
}

fn f32s<T: CudaElement>(x: &[T]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

impl<T: CudaElement> DilatedBackend for Emulated<T> {
    fn name(&self) -> String {
        let (f, b) = (self.opts, self.bwd);
        let (dtype, rows, stages, mma) = (T::DTYPE.as_str(), f.rows.name(), f.stages.name(), f.mma.name());
        format!("cuda-emulation {dtype} {mma} rows {rows} {:?} stages {stages}, backward {b:?}", f.fusion)
    }

    fn dtype(&self) -> DType {
        T::DTYPE
    }

    fn forward(&self, p: &Problem<'_>, [q, k, v]: [&[f32]; 3]) -> Result<Forward32> {
        let (out, lse) = self.run_forward(p, &conv(q), &conv(k), &conv(v))?;
        Ok(Forward32 { out: f32s(&out), lse })
    }

    fn backward(&self, p: &Problem<'_>, qkv: [&[f32]; 3], grad_out: &[f32]) -> Result<Gradients32> {
        self.gradients(p, qkv, grad_out, None)
    }

    fn backward_lse(&self, p: &Problem<'_>, qkv: [&[f32]; 3], go: &[f32], grad_lse: &[f32]) -> Result<Gradients32> {
        self.gradients(p, qkv, go, Some(grad_lse))
    }
}

impl<T: CudaElement> Emulated<T> {
    /// The gradients stored in `T`, with an optional gradient into the LSE.
    fn gradients(
        &self,
        p: &Problem<'_>,
        qkv: [&[f32]; 3],
        grad_out: &[f32],
        grad_lse: Option<&[f32]>,
    ) -> Result<Gradients32> {
        self.gradients_on(emulator_for(self.opts, self.bwd), p, qkv, grad_out, grad_lse)
    }

    /// [`Self::gradients`] with the backward on `emu` (its own options and block order).
    pub(crate) fn gradients_on(
        &self,
        emu: &Emulator,
        p: &Problem<'_>,
        qkv: [&[f32]; 3],
        grad_out: &[f32],
        grad_lse: Option<&[f32]>,
    ) -> Result<Gradients32> {
        let (sq, skv) = (p.shape.q, p.shape.kv);
        let [q, k, v, go]: [Vec<T>; 4] = [qkv[0], qkv[1], qkv[2], grad_out].map(conv);
        let (out, lse) = self.run_forward(p, &q, &k, &v)?;
        let kpad = flags(p);
        let args = HostArgs {
            q: &q,
            k: &k,
            v: &v,
            g: Some(&go),
            lse: Some(&lse),
            delta: None,
            kpad: kpad.as_deref(),
            bmask: block_keep(p),
        };
        // Gradients that start as garbage: the call must write every element.
        let seven = T::from_f32(7.0);
        let (mut dq, mut dk, mut dv) = (vec![seven; sq.numel()], vec![seven; skv.numel()], vec![seven; skv.numel()]);
        let g = geometry(p, Some(sq.contiguous_strides()));
        let mut pool = self.pool.lock().unwrap();
        emu.backward_call(&g, &args, (&out, grad_lse), &mut pool, [&mut dq, &mut dk, &mut dv])?;
        Ok(Gradients32 { dq: f32s(&dq), dk: f32s(&dk), dv: f32s(&dv) })
    }

    /// Scratch buffers this backend's whole calls have allocated.
    pub(crate) fn scratch_allocations(&self) -> u64 {
        self.pool.lock().unwrap().allocations()
    }
}

#[test]
fn the_emulation_runs_every_kernel_of_the_source() {
    use attn_kernels::cuda::source::{kernel_names, sm90a_kernel_names_for};
    let sm90a = ["f16", "bf16"].map(|t| sm90a_kernel_names_for(t).len()).iter().sum::<usize>();
    assert_eq!(emulator().kernel_count().unwrap(), kernel_names().len() + sm90a);
}

#[test]
fn emulated_cuda_golden_f32() {
    assert_attention_dirs_pass(&Emulated::<f32>::new(ForwardRows::M64));
}

#[test]
fn emulated_cuda_golden_bf16() {
    assert_attention_dirs_pass(&Emulated::<bf16>::new(ForwardRows::M64));
}

#[test]
fn emulated_cuda_golden_f16() {
    assert_attention_dirs_pass(&Emulated::<f16>::new(ForwardRows::M64));
}
