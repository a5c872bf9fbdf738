//! The CUDA kernels run on the CPU as an executor of this crate's own launch plans:
//! `kernels/emulation/emu_capi.cpp` (the `.cu` files over `emu_runtime.hpp`) built into a
//! shared library by the host C++ compiler and loaded at run time. Host slices stand in for
//! device buffers; the launches are the plans of [`crate::cuda::plan::launch_plan`] and the epilogue
//! launches the device runs, so a test here covers the Rust planning and the kernels
//! together. For tests: one OS thread per CUDA thread, launches serialised, slow.
#![allow(unsafe_code)]

mod maps;

use std::collections::BTreeMap;
use std::ffi::{CString, c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

use attn_core::error::TensorName;
use attn_core::{AttnError, Result, Shape4};
use cudarc::driver::LaunchConfig;
use libloading::Library;

use super::call::ForwardPath;
use super::epilogue::{delta_kernel, row_params, store_kernel};
use super::scratch::{HostMemory, ScratchPool, ScratchSlot, WORK_COUNTER_LEN, backward_slots};
use super::tensor::{CudaElement, extent, fill_launch};
use crate::cuda::plan::launch_plan::{
    BlockGeometry, DirectGrads, Planned, Signature, plan_backward, plan_backward_direct, plan_forward,
    plan_forward_direct,
};
use crate::cuda::plan::patterns::{
    BackwardDq, BackwardKeys, BackwardLoads, BackwardOptions, BackwardQueries, BackwardWrites, ForwardMma,
    ForwardOptions, ForwardRows, ForwardStages, PatternFusion, out_scale,
};
use crate::cuda::plan::source::MAX_HEAD_DIM;

type LaunchFn = unsafe extern "C" fn(*const c_char, u32, u32, u32, u32, u32, u64, *mut *mut c_void) -> c_int;
type CountFn = unsafe extern "C" fn() -> c_int;

/// Blocks a persistent launch's grid is cut to in the emulation (the device's: SMs times
/// blocks an SM holds): fewer than most launches' items, so blocks take several each.
const EMULATED_RESIDENT_BLOCKS: u32 = 3;

fn emu_err(message: impl Into<String>) -> AttnError {
    AttnError::BackendUnavailable { backend: "cuda-emulation", reason: message.into() }
}

/// The loaded emulation library, planning the forward with its [`ForwardOptions`] and the
/// backward with its [`BackwardOptions`], running each grid's blocks in its [`BlockOrder`].
#[derive(Debug)]
pub struct Emulator {
    lib: Library,
    forward: ForwardOptions,
    backward: BackwardOptions,
    order: BlockOrder,
    /// Launches run, by kernel name.
    launched: Mutex<BTreeMap<String, u64>>,
}

/// The order an emulated launch runs its blocks in: `Grid` (x fastest, then y, then z), or
/// `Shuffled(seed)`, a permutation drawn from a non-zero seed, as a GPU may schedule them
/// in any order (sums by atomics then round differently).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BlockOrder {
    #[default]
    Grid,
    Shuffled(std::num::NonZeroU64),
}

impl BlockOrder {
    fn seed(self) -> u64 {
        match self {
            BlockOrder::Grid => 0,
            BlockOrder::Shuffled(s) => s.get(),
        }
    }
}

/// A block's inputs in host memory (as the device call's buffers): q, k, v, grad_out in
/// their geometry's strides, the final lse and delta `[batch, q rows, heads]`, the key
/// padding flags `[batch, kpad_seq]`, the block mask's entries (sizes in the geometry).
#[derive(Debug, Clone, Copy)]
pub struct HostArgs<'a, T> {
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
    pub g: Option<&'a [T]>,
    pub lse: Option<&'a [f32]>,
    pub delta: Option<&'a [f32]>,
    pub kpad: Option<&'a [u8]>,
    pub bmask: Option<&'a [u8]>,
}

/// What direct launches write on the host: a direct forward's output, or a whole call's
/// dq, dk and dv ([`plan_backward_direct`]).
#[derive(Default)]
struct HostOuts<'a, T> {
    out: Option<&'a mut [T]>,
    dq: Option<&'a mut [T]>,
    dkv: Option<(&'a mut [T], &'a mut [T])>,
}

/// A block's f32 accumulators in host memory: out (forward) or dq (backward) like q, the
/// forward's lse, dk and dv like k.
#[derive(Debug)]
pub struct HostAccs<'a> {
    pub q_acc: &'a mut [f32],
    pub lse: Option<&'a mut [f32]>,
    pub dk: Option<&'a mut [f32]>,
    pub dv: Option<&'a mut [f32]>,
}

fn too_small(tensor: TensorName, len: usize, needed: usize) -> AttnError {
    AttnError::BufferTooSmall { tensor, len, needed }
}

fn need(tensor: TensorName, len: usize, needed: usize) -> Result<()> {
    if len < needed { Err(too_small(tensor, len, needed)) } else { Ok(()) }
}

/// Check that every buffer covers what the block's launches index.
fn check_buffers<T>(g: &BlockGeometry<'_>, a: &HostArgs<'_, T>, acc: &HostAccs<'_>) -> Result<()> {
    let ((qs, qst), (ks, kst)) = (g.q, g.k);
    if qs.head_dim > MAX_HEAD_DIM || ks.head_dim != qs.head_dim || ks.batch != qs.batch {
        return Err(AttnError::InvalidArgument(format!("emulated block of q {:?} and k {:?}", qs.dims(), ks.dims())));
    }
    need(TensorName::Query, a.q.len(), extent(qs, qst))?;
    need(TensorName::Key, a.k.len(), extent(ks, kst))?;
    need(TensorName::Value, a.v.len(), extent(ks, g.v_strides))?;
    if let (Some(gs), Some(go)) = (g.g_strides, a.g) {
        need(TensorName::GradOutput, go.len(), extent(qs, gs))?;
    }
    for (name, x) in [(TensorName::Lse, a.lse), (TensorName::Other("delta"), a.delta)] {
        need(name, x.map_or(usize::MAX, <[f32]>::len), qs.lse_len())?;
    }
    need(TensorName::Output, acc.q_acc.len(), qs.numel())?;
    for (name, x) in [(TensorName::GradKey, &acc.dk), (TensorName::GradValue, &acc.dv)] {
        need(name, x.as_ref().map_or(usize::MAX, |x| x.len()), ks.numel())?;
    }
    need(TensorName::Lse, acc.lse.as_ref().map_or(usize::MAX, |x| x.len()), qs.lse_len())?;
    if let Some(seq) = g.kpad_seq {
        let flags = a.kpad.ok_or_else(|| emu_err("the plan reads a key padding mask the call does not have"))?;
        need(TensorName::KeyPaddingMask, flags.len(), ks.batch * seq)?;
        if g.k_start + ks.seq > seq {
            return Err(AttnError::InvalidArgument(format!("the mask's {seq} keys end before the block's")));
        }
    }
    if let Some(m) = g.block_mask {
        let keep = a.bmask.ok_or_else(|| emu_err("the plan reads a block mask the call does not have"))?;
        let (d, rows) = (m.dims, |n: usize| n.div_ceil(m.block_size.max(1)));
        let longest = g.packing.map(|p| p.iter().map(|r| r.len()).max().unwrap_or(0));
        let (q_end, k_end) = longest.map_or((g.q_start + qs.seq, g.k_start + ks.seq), |n| (n, n));
        if d.len() != Some(keep.len()) || rows(q_end) > d.q_blocks || rows(k_end) > d.k_blocks {
            return Err(AttnError::InvalidBlockMask(format!(
                "{} entries of sizes {:?} for queries to {q_end} and keys to {k_end}",
                keep.len(),
                [d.batch, d.heads, d.q_blocks, d.k_blocks]
            )));
        }
        if (d.batch != 1 && d.batch != qs.batch) || (d.heads != 1 && d.heads != qs.heads) {
            return Err(AttnError::InvalidBlockMask(format!("sizes {:?} for q {:?}", [d.batch, d.heads], qs.dims())));
        }
    }
    Ok(())
}

/// The address of element `at` of `x`, or an error naming `tensor` when it lies beyond.
fn at<T>(tensor: TensorName, x: &[T], at: usize) -> Result<*const T> {
    x.get(at..).map(<[T]>::as_ptr).ok_or_else(|| too_small(tensor, x.len(), at))
}

fn at_mut<T>(tensor: TensorName, x: &mut [T], at: usize) -> Result<*mut T> {
    let len = x.len();
    x.get_mut(at..).map(<[T]>::as_mut_ptr).ok_or_else(|| too_small(tensor, len, at))
}

fn missing(what: &str) -> AttnError {
    AttnError::InvalidArgument(format!("a planned launch needs {what}, which the call does not have"))
}

impl Emulator {
    /// The C++ source of the library.
    pub fn source() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/emulation/emu_capi.cpp")
    }

    /// Build the library at `out` with the C++ compiler `cxx` (C++20, pthreads).
    pub fn build(cxx: &str, out: &Path) -> Result<()> {
        let status = Command::new(cxx)
            .args(["-std=c++20", "-O2", "-pthread", "-shared", "-fPIC"])
            .arg(Self::source())
            .arg("-o")
            .arg(out)
            .status()
            .map_err(|e| emu_err(format!("running {cxx}: {e}")))?;
        if status.success() {
            Ok(())
        } else {
            Err(emu_err(format!("{cxx} failed to build {} ({status})", out.display())))
        }
    }

    /// Where [`Emulator::build_and_load`] puts the library in `dir`.
    pub fn library_path(dir: &Path) -> PathBuf {
        dir.join("libattn_cuda_emu.so")
    }

    /// Build the library into `dir` with the C++ compiler `$CXX` (default `g++`) and load it.
    pub fn build_and_load(dir: &Path) -> Result<Self> {
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
        let out = Self::library_path(dir);
        Self::build(&cxx, &out)?;
        Self::load(&out)
    }

    /// The process's emulator: built into `dir` and loaded by the first call, the same (or
    /// the same error) for every later call.
    pub fn shared(dir: &Path) -> Result<&'static Emulator> {
        static SHARED: OnceLock<std::result::Result<Emulator, String>> = OnceLock::new();
        SHARED
            .get_or_init(|| Self::build_and_load(dir).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| emu_err(e.clone()))
    }

    /// Load a library [`Emulator::build`] made (the forward's rows a block and pattern
    /// fusion, the backward's query-tile loads and keys a block from the environment
    /// variables a device reads, each unset one the [`Default`]: no architecture is
    /// emulated).
    pub fn load(path: &Path) -> Result<Self> {
        let forward = ForwardOptions::from_env_or(ForwardOptions::default())?;
        let backward = BackwardOptions::from_env_or(BackwardOptions::default())?;
        // SAFETY: the library is ours (emu_capi.cpp); loading runs its static initialisers only.
        let lib = unsafe { Library::new(path) }.map_err(|e| emu_err(format!("loading {}: {e}", path.display())))?;
        Ok(Emulator { lib, forward, backward, order: BlockOrder::Grid, launched: Mutex::default() })
    }

    /// This emulator running every grid's blocks in `order`.
    pub fn with_block_order(self, order: BlockOrder) -> Self {
        Emulator { order, ..self }
    }

    /// This emulator planning the backward's dq sum as `dq` says.
    pub fn with_backward_dq(self, dq: BackwardDq) -> Self {
        Emulator { backward: BackwardOptions { dq, ..self.backward }, ..self }
    }

    /// This emulator planning the tensor-core backward's query-tile loads as `loads` says.
    pub fn with_backward_loads(self, loads: BackwardLoads) -> Self {
        Emulator { backward: BackwardOptions { loads, ..self.backward }, ..self }
    }

    /// This emulator planning the tensor-core backward with `keys` keys a block.
    pub fn with_backward_keys(self, keys: BackwardKeys) -> Self {
        Emulator { backward: BackwardOptions { keys, ..self.backward }, ..self }
    }

    /// This emulator planning the tensor-core forward with `rows` query rows a block.
    pub fn with_forward_rows(self, rows: ForwardRows) -> Self {
        Emulator { forward: ForwardOptions { rows, ..self.forward }, ..self }
    }

    /// This emulator's whole-call backward writing dk and dv as `writes` says.
    pub fn with_backward_writes(self, writes: BackwardWrites) -> Self {
        Emulator { backward: BackwardOptions { writes, ..self.backward }, ..self }
    }

    /// This emulator planning the tensor-core backward with query tiles of `queries` rows.
    pub fn with_backward_queries(self, queries: BackwardQueries) -> Self {
        Emulator { backward: BackwardOptions { queries, ..self.backward }, ..self }
    }

    /// This emulator planning the tensor-core forward with `stages` K/V stages.
    pub fn with_forward_stages(self, stages: ForwardStages) -> Self {
        Emulator { forward: ForwardOptions { stages, ..self.forward }, ..self }
    }

    /// This emulator planning the f16/bf16 forward's instructions as `mma` says:
    /// [`ForwardMma::Wgmma`] emulates an sm_90a device, whose forward takes the TMA and
    /// wgmma kernel where a launch can.
    pub fn with_forward_mma(self, mma: ForwardMma) -> Self {
        Emulator { forward: ForwardOptions { mma, ..self.forward }, ..self }
    }

    /// How many launches of each kernel this emulator has run.
    pub fn launches(&self) -> BTreeMap<String, u64> {
        self.launched.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// This emulator planning the tensor-core forward's patterns as `fusion` says.
    pub fn with_pattern_fusion(self, fusion: PatternFusion) -> Self {
        Emulator { forward: ForwardOptions { fusion, ..self.forward }, ..self }
    }

    /// How many kernels the library runs.
    pub fn kernel_count(&self) -> Result<usize> {
        // SAFETY: `attn_emu_kernel_count` has this signature in emu_capi.cpp.
        let f = unsafe { self.lib.get::<CountFn>(b"attn_emu_kernel_count") }.map_err(|e| emu_err(e.to_string()))?;
        // SAFETY: no arguments; reads a static table.
        Ok(unsafe { f() } as usize)
    }

    /// Run kernel `name` over `lc` (grid, `block_dim.0` threads, dynamic shared memory);
    /// `args` point at each argument's value, in the kernel's order.
    fn launch(&self, name: &str, lc: LaunchConfig, args: &mut [*mut c_void]) -> Result<()> {
        // SAFETY: `attn_emu_launch` has this signature in emu_capi.cpp.
        let f = unsafe { self.lib.get::<LaunchFn>(b"attn_emu_launch") }.map_err(|e| emu_err(e.to_string()))?;
        let cname = CString::new(name).map_err(|_| emu_err("kernel name with a NUL byte"))?;
        let ((gx, gy, gz), threads) = (lc.grid_dim, lc.block_dim.0);
        let (smem, order) = (lc.shared_mem_bytes, self.order.seed());
        // SAFETY: the callers pass one pointer per argument of the kernel's signature, each to
        // a live value of the argument's type, buffers checked against what the launch indexes.
        let rc = unsafe { f(cname.as_ptr(), gx, gy, gz, threads, smem, order, args.as_mut_ptr()) };
        *self.launched.lock().unwrap_or_else(|e| e.into_inner()).entry(name.to_string()).or_default() += 1;
        match rc {
            0 => Ok(()),
            2 => Err(emu_err(format!(
                "kernel `{name}` left cp.async copies in flight at a block's end (a missing wait)"
            ))),
            3 => Err(emu_err(format!(
                "kernel `{name}` wrote past the {} bytes of dynamic shared memory it was launched with",
                lc.shared_mem_bytes
            ))),
            4 => Err(emu_err(format!("kernel `{name}` made a vector access off its alignment (a fault on a GPU)"))),
            5 => Err(emu_err(format!(
                "kernel `{name}` misused an mbarrier, a wgmma descriptor or a TMA copy, left that work in flight, or deadlocked"
            ))),
            _ => Err(emu_err(format!("the emulation has no kernel `{name}`"))),
        }
    }

    /// Run planned launches on host buffers (`outs`: what direct launches write), the
    /// persistent ones' work counter from `pool` where there is one (else a new one).
    fn execute<T: CudaElement>(
        &self,
        plan: &[Planned],
        a: &HostArgs<'_, T>,
        acc: HostAccs<'_>,
        outs: HostOuts<'_, T>,
        pool: Option<&mut ScratchPool<Vec<f32>>>,
    ) -> Result<()> {
        if !plan.iter().any(|p| p.work) {
            return self.execute_with(plan, a, acc, outs, &mut []);
        }
        let mut fresh = ScratchPool::default();
        let pool = pool.unwrap_or(&mut fresh);
        let mut work = pool.take(&HostMemory, ScratchSlot::WorkCounter, WORK_COUNTER_LEN)?;
        let done = self.execute_with(plan, a, acc, outs, &mut work);
        // Each launch's last block zeroes the counter: the next launch needs no fill.
        let left = work.iter().map(|w| w.to_bits()).collect::<Vec<u32>>();
        pool.give(ScratchSlot::WorkCounter, work);
        done?;
        match left.iter().all(|&w| w == 0) {
            true => Ok(()),
            false => Err(emu_err(format!("a persistent launch left its work counter at {left:?}, not zeroed"))),
        }
    }

    /// [`execute`](Self::execute) with the work counter `work` (empty where no launch is
    /// persistent).
    fn execute_with<T: CudaElement>(
        &self,
        plan: &[Planned],
        a: &HostArgs<'_, T>,
        acc: HostAccs<'_>,
        outs: HostOuts<'_, T>,
        work: &mut [f32],
    ) -> Result<()> {
        let HostAccs { q_acc, mut lse, mut dk, mut dv } = acc;
        let HostOuts { out: mut direct, dq: mut dq_out, mut dkv } = outs;
        let start = |s: &[T]| s.as_ptr() as u64;
        let g_start = a.g.map(start).or_else(|| direct.as_deref().map(start));
        let starts = [Some(start(a.q)), Some(start(a.k)), Some(start(a.v)), g_start];
        for planned in plan {
            let (p, maps) = maps::hopper_launch(&self.lib, planned, [a.q, a.k, a.v], starts)?;
            let o = p.offsets;
            let mut params = p.params_at(starts, size_of::<T>());
            if p.kpad {
                params.kpad += a.kpad.ok_or_else(|| missing("a key padding mask"))?.as_ptr() as u64;
            }
            if p.bmask {
                params.bmask = a.bmask.ok_or_else(|| missing("a block mask"))?.as_ptr() as u64;
            }
            let mut grid_dim = p.grid;
            if p.work {
                need(TensorName::Other("work counter"), work.len(), WORK_COUNTER_LEN)?;
                params.work = work.as_mut_ptr() as u64;
                grid_dim.0 = grid_dim.0.min(EMULATED_RESIDENT_BLOCKS);
            }
            let (mut q, mut k, mut v) =
                (at(TensorName::Query, a.q, o.q)?, at(TensorName::Key, a.k, o.k)?, at(TensorName::Value, a.v, o.v)?);
            let mut args: Vec<*mut c_void> =
                vec![(&raw mut q).cast::<c_void>(), (&raw mut k).cast::<c_void>(), (&raw mut v).cast::<c_void>()];
            let (mut out, mut lse_acc);
            let (mut g, mut l, mut dl, mut dq, mut dkp, mut dvp);
            let (mut out_t, mut dqo, mut dko, mut dvo);
            if matches!(p.signature, Signature::Forward | Signature::ForwardDirect) {
                if p.signature == Signature::Forward {
                    out = at_mut(TensorName::Output, q_acc, o.q_acc)?;
                    args.push((&raw mut out).cast());
                } else {
                    let dst = direct.as_deref_mut().ok_or_else(|| missing("an output"))?;
                    out_t = at_mut(TensorName::Output, dst, o.g)?;
                    args.push((&raw mut out_t).cast());
                }
                let lse = lse.as_deref_mut().ok_or_else(|| missing("an lse accumulator"))?;
                lse_acc = at_mut(TensorName::Lse, lse, o.q_rows)?;
                args.push((&raw mut lse_acc).cast());
            } else {
                g = at(TensorName::GradOutput, a.g.ok_or_else(|| missing("grad_out"))?, o.g)?;
                l = at(TensorName::Lse, a.lse.ok_or_else(|| missing("the lse"))?, o.q_rows)?;
                dl = at(TensorName::Other("delta"), a.delta.ok_or_else(|| missing("delta"))?, o.q_rows)?;
                args.extend([(&raw mut g).cast(), (&raw mut l).cast(), (&raw mut dl).cast()]);
                if p.signature == Signature::BackwardDq && p.params.out_direct != 0 {
                    dqo = at_mut(TensorName::GradQuery, dq_out.as_deref_mut().ok_or_else(|| missing("dq"))?, o.q)?;
                    args.push((&raw mut dqo).cast());
                } else if matches!(p.signature, Signature::BackwardAll | Signature::BackwardDq) {
                    dq = at_mut(TensorName::GradQuery, q_acc, o.q_acc)?;
                    args.push((&raw mut dq).cast());
                }
                if matches!(p.signature, Signature::BackwardAll | Signature::BackwardDkv) && p.params.out_direct != 0 {
                    let (dk_out, dv_out) = dkv.as_mut().ok_or_else(|| missing("dk and dv"))?;
                    dko = at_mut(TensorName::GradKey, dk_out, o.k)?;
                    dvo = at_mut(TensorName::GradValue, dv_out, o.v)?;
                    args.extend([(&raw mut dko).cast(), (&raw mut dvo).cast()]);
                } else if matches!(p.signature, Signature::BackwardAll | Signature::BackwardDkv) {
                    dkp = at_mut(TensorName::GradKey, dk.as_deref_mut().ok_or_else(|| missing("dk"))?, o.k_acc)?;
                    dvp = at_mut(TensorName::GradValue, dv.as_deref_mut().ok_or_else(|| missing("dv"))?, o.k_acc)?;
                    args.extend([(&raw mut dkp).cast(), (&raw mut dvp).cast()]);
                }
            }
            args.push((&raw mut params).cast());
            let mut map_ptr = maps.as_ref().map(maps::EmulatedMaps::as_ptr);
            if let Some(m) = map_ptr.as_mut() {
                args.push((m as *mut *const c_void).cast());
            }
            let lc = LaunchConfig { grid_dim, block_dim: (p.threads, 1, 1), shared_mem_bytes: p.smem_bytes };
            self.launch(&p.kernel, lc, &mut args)?;
        }
        Ok(())
    }

    /// [`crate::cuda::forward_block`] on host buffers: LSE-merge the block into `acc.q_acc`
    /// (out) and `acc.lse`.
    pub fn forward_block<T: CudaElement>(
        &self,
        g: &BlockGeometry<'_>,
        a: &HostArgs<'_, T>,
        acc: HostAccs<'_>,
    ) -> Result<()> {
        self.forward_block_in(g, a, acc, None)
    }

    /// [`forward_block`](Self::forward_block), a persistent launch's work counter from `pool`.
    fn forward_block_in<T: CudaElement>(
        &self,
        g: &BlockGeometry<'_>,
        a: &HostArgs<'_, T>,
        acc: HostAccs<'_>,
        pool: Option<&mut ScratchPool<Vec<f32>>>,
    ) -> Result<()> {
        check_buffers(g, a, &acc)?;
        self.execute(&plan_forward(g, T::DTYPE, T::SUFFIX, self.forward)?, a, acc, HostOuts::default(), pool)
    }

    /// [`crate::cuda::forward_call`] on host buffers: the forward of a whole call (`g`
    /// without packing offsets past the call, `g.g_strides` the output's contiguous
    /// strides) written into `out` (in `T`, q's shape) and `lse`, straight from the kernel
    /// under [`ForwardPath::Direct`] where that applies, through a partial from `pool`
    /// otherwise (as the device takes it from its stream's pool).
    pub fn forward_call<T: CudaElement>(
        &self,
        g: &BlockGeometry<'_>,
        a: &HostArgs<'_, T>,
        path: ForwardPath,
        (out, lse): (&mut [T], &mut [f32]),
        pool: &mut ScratchPool<Vec<f32>>,
    ) -> Result<()> {
        let shape = g.q.0;
        if g.g_strides != Some(shape.contiguous_strides()) {
            return Err(AttnError::InvalidArgument("a whole-call forward writes a contiguous output".into()));
        }
        need(TensorName::Output, out.len(), shape.numel())?;
        let direct = match path {
            ForwardPath::Direct => plan_forward_direct(g, T::DTYPE, T::SUFFIX, self.forward)?,
            ForwardPath::Partial => None,
        };
        self.fill_lse::<T>(lse, f32::NEG_INFINITY)?;
        let Some(plan) = direct else {
            let mut partial = pool.take(&HostMemory, ScratchSlot::PartialOut, shape.numel())?;
            partial.fill(0.0);
            let acc = HostAccs { q_acc: &mut partial, lse: Some(lse), dk: None, dv: None };
            let done = self
                .forward_block_in(g, a, acc, Some(&mut *pool))
                .and_then(|()| self.store_scaled(shape, &partial, out_scale(g.cfg), out));
            pool.give(ScratchSlot::PartialOut, partial);
            return done;
        };
        // The direct kernels never read the accumulator: an empty one passes the checks.
        let mut none = vec![0.0f32; shape.numel()];
        let acc = HostAccs { q_acc: &mut none, lse: Some(lse), dk: None, dv: None };
        check_buffers(g, a, &acc)?;
        out.fill(T::default());
        self.execute(&plan, a, acc, HostOuts { out: Some(out), ..HostOuts::default() }, Some(pool))
    }

    /// [`crate::cuda::backward_call`] on host buffers: the gradients of a whole call (`a`
    /// holding q, k, v, grad_out, the forward's lse and the key padding; `out` the forward's
    /// output) written into `dq`, `dk`, `dv` (in `T`, contiguous), the f32 accumulators and
    /// delta taken from `pool` and given back, as the device's pooled call does.
    pub fn backward_call<T: CudaElement>(
        &self,
        g: &BlockGeometry<'_>,
        a: &HostArgs<'_, T>,
        (out, grad_lse): (&[T], Option<&[f32]>),
        pool: &mut ScratchPool<Vec<f32>>,
        [dq, dk, dv]: [&mut [T]; 3],
    ) -> Result<()> {
        let (qs, ks) = (g.q.0, g.k.0);
        let (go, lse) = (a.g.ok_or_else(|| missing("grad_out"))?, a.lse.ok_or_else(|| missing("the lse"))?);
        // Direct gradients where asked and planned (the outputs are contiguous; so must the
        // inputs be, to be laid out like them).
        let allowed = DirectGrads::from_parts(
            g.q.1 == qs.contiguous_strides(),
            g.k.1 == ks.contiguous_strides() && g.v_strides == ks.contiguous_strides(),
        );
        let direct = match (self.backward.writes, allowed) {
            (BackwardWrites::Direct, Some(allowed)) => {
                plan_backward_direct(g, T::DTYPE, T::SUFFIX, self.backward, allowed)?
            }
            _ => None,
        };
        let slots = backward_slots(qs, ks, direct.as_ref().map(|d| d.grads));
        let mut bufs: [Option<Vec<f32>>; 4] = Default::default();
        for (buf, slot) in bufs.iter_mut().zip(slots) {
            *buf = slot.map(|(slot, len)| pool.take(&HostMemory, slot, len)).transpose()?;
        }
        let done = (|| {
            let [delta, dq_acc, dk_acc, dv_acc] = &mut bufs;
            let delta = delta.as_mut().ok_or_else(|| missing("delta scratch"))?;
            self.delta_into(qs, go, out, grad_lse.map(|g| (g, lse)), delta)?;
            let args = HostArgs { delta: Some(&delta[..]), ..*a };
            for acc in [&mut *dq_acc, &mut *dk_acc, &mut *dv_acc].into_iter().flatten() {
                acc.fill(0.0);
            }
            // Accumulated gradients need their scratch; direct ones none (an empty stand-in
            // passes the checks, the direct kernels never read it).
            let mut none = Vec::new();
            match &direct {
                Some(plan) => {
                    let q_acc = match dq_acc.as_mut() {
                        Some(acc) => acc,
                        None => {
                            none = vec![0.0f32; qs.numel()];
                            &mut none
                        }
                    };
                    let acc = HostAccs { q_acc, lse: None, dk: dk_acc.as_deref_mut(), dv: dv_acc.as_deref_mut() };
                    check_buffers(g, &args, &acc)?;
                    let dq_out = plan.grads.dq().then(|| {
                        dq.fill(T::default());
                        &mut *dq
                    });
                    let dkv = plan.grads.dkv().then(|| {
                        dk.fill(T::default());
                        dv.fill(T::default());
                        (&mut *dk, &mut *dv)
                    });
                    self.execute(&plan.launches, &args, acc, HostOuts { out: None, dq: dq_out, dkv }, None)?;
                }
                None => {
                    let (Some(q_acc), Some(dk), Some(dv)) = (dq_acc.as_mut(), dk_acc.as_mut(), dv_acc.as_mut()) else {
                        return Err(missing("every accumulator"));
                    };
                    let acc = HostAccs { q_acc, lse: None, dk: Some(&mut dk[..]), dv: Some(&mut dv[..]) };
                    self.backward_block(g, &args, acc)?;
                }
            }
            drop(none);
            if let Some(acc) = dq_acc {
                self.store_scaled(qs, acc, 1.0, dq)?;
            }
            if let (Some(dk_acc), Some(dv_acc)) = (dk_acc, dv_acc) {
                self.store_scaled(ks, dk_acc, 1.0, dk)?;
                self.store_scaled(ks, dv_acc, 1.0, dv)?;
            }
            Ok(())
        })();
        for (buf, slot) in bufs.into_iter().zip(slots) {
            if let (Some(buf), Some((slot, _))) = (buf, slot) {
                pool.give(slot, buf);
            }
        }
        done
    }

    /// [`crate::cuda::backward_block`] on host buffers: add the block's gradients to
    /// `acc.q_acc` (dq), `acc.dk` and `acc.dv`.
    pub fn backward_block<T: CudaElement>(
        &self,
        g: &BlockGeometry<'_>,
        a: &HostArgs<'_, T>,
        acc: HostAccs<'_>,
    ) -> Result<()> {
        if g.g_strides.is_none() {
            return Err(missing("grad_out strides"));
        }
        check_buffers(g, a, &acc)?;
        self.execute(&plan_backward(g, T::DTYPE, T::SUFFIX, self.backward)?, a, acc, HostOuts::default(), None)
    }

    /// [`crate::cuda::store_scaled`] into a contiguous host tensor: `dst = scale * src` in `T`.
    pub fn store_scaled<T: CudaElement>(&self, shape: Shape4, src: &[f32], scale: f32, dst: &mut [T]) -> Result<()> {
        need(TensorName::Other("f32 source"), src.len(), shape.numel())?;
        need(TensorName::Output, dst.len(), shape.numel())?;
        let strides = shape.contiguous_strides();
        let mut p = row_params(shape, strides, strides, scale);
        let (name, lc) = store_kernel(T::SUFFIX, shape, strides, dst.as_ptr() as u64, size_of::<T>());
        let (mut s, mut d) = (src.as_ptr(), dst.as_mut_ptr());
        let mut args: Vec<*mut c_void> = vec![(&raw mut s).cast(), (&raw mut d).cast(), (&raw mut p).cast()];
        self.launch(&name, lc, &mut args)
    }

    /// The device's lse fill (`fill_lse_*` of `T`'s module): every value of `dst` set to `value`.
    pub fn fill_lse<T: CudaElement>(&self, dst: &mut [f32], value: f32) -> Result<()> {
        let (mut d, mut v, mut n) = (dst.as_mut_ptr(), value, dst.len() as i64);
        let mut args: Vec<*mut c_void> = vec![(&raw mut d).cast(), (&raw mut v).cast(), (&raw mut n).cast()];
        let lc = fill_launch(dst.len());
        self.launch(&format!("fill_lse_{}", T::SUFFIX), lc, &mut args)
    }

    /// [`crate::cuda::delta`] of contiguous host tensors: `dot(grad_out, out) - grad_lse`
    /// per row, `lse_grad` being `(grad_lse, lse)` (`grad_lse` read where `lse` is finite).
    pub fn delta<T: CudaElement>(
        &self,
        shape: Shape4,
        grad_out: &[T],
        out: &[T],
        lse_grad: Option<(&[f32], &[f32])>,
    ) -> Result<Vec<f32>> {
        let mut delta = vec![0.0f32; shape.lse_len()];
        self.delta_into(shape, grad_out, out, lse_grad, &mut delta)?;
        Ok(delta)
    }

    /// [`Self::delta`] written into `delta`.
    pub fn delta_into<T: CudaElement>(
        &self,
        shape: Shape4,
        grad_out: &[T],
        out: &[T],
        lse_grad: Option<(&[f32], &[f32])>,
        delta: &mut [f32],
    ) -> Result<()> {
        need(TensorName::GradOutput, grad_out.len(), shape.numel())?;
        need(TensorName::Output, out.len(), shape.numel())?;
        need(TensorName::Other("delta"), delta.len(), shape.lse_len())?;
        if let Some((g, l)) = lse_grad {
            need(TensorName::GradLse, g.len(), shape.lse_len())?;
            need(TensorName::Lse, l.len(), shape.lse_len())?;
        }
        let strides = shape.contiguous_strides();
        let mut p = row_params(shape, strides, strides, 1.0);
        let at = |x: &[T]| (strides, x.as_ptr() as u64);
        let (name, lc) = delta_kernel(T::SUFFIX, shape, [at(grad_out), at(out)], size_of::<T>())?;
        let (mut g, mut o, mut dl) = (grad_out.as_ptr(), out.as_ptr(), delta.as_mut_ptr());
        let (mut gl, mut l) = lse_grad.map_or((std::ptr::null(), std::ptr::null()), |(g, l)| (g.as_ptr(), l.as_ptr()));
        let mut args: Vec<*mut c_void> = vec![
            (&raw mut g).cast(),
            (&raw mut o).cast(),
            (&raw mut gl).cast(),
            (&raw mut l).cast(),
            (&raw mut dl).cast(),
            (&raw mut p).cast(),
        ];
        self.launch(&name, lc, &mut args)
    }
}
