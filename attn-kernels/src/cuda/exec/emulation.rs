//! The CUDA kernels run on the CPU as an executor of this crate's own launch plans:
//! `kernels/emulation/emu_capi.cpp` (the `.cu` files over `emu_runtime.hpp`) built into a
//! shared library by the host C++ compiler and loaded at run time. Host slices stand in for
//! device buffers; the launches are the plans of [`crate::cuda::plan::launch_plan`] and the epilogue
//! launches the device runs, so a test here covers the Rust planning and the kernels
//! together. For tests: one OS thread per CUDA thread, launches serialised, slow. This
//! module loads the library and launches one kernel; `buffers` checks the host buffers,
//! `execute` runs planned launches, `calls` the block and whole-call steps.
#![allow(unsafe_code)]

mod buffers;
mod calls;
mod execute;
mod maps;

use std::collections::BTreeMap;
use std::ffi::{CString, c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

use attn_core::{AttnError, Result};
use cudarc::driver::LaunchConfig;
use libloading::Library;

use crate::cuda::plan::patterns::{
    BackwardDq, BackwardKeys, BackwardLoads, BackwardMma, BackwardOptions, BackwardQueries, BackwardWrites, ForwardMma,
    ForwardOptions, ForwardRows, ForwardStages, PatternFusion,
};
pub use buffers::{HostAccs, HostArgs};

type LaunchFn = unsafe extern "C" fn(*const c_char, u32, u32, u32, u32, u32, u64, *mut *mut c_void) -> c_int;
type CountFn = unsafe extern "C" fn() -> c_int;

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

    /// This emulator planning the f16/bf16 backward's instructions as `mma` says:
    /// [`BackwardMma::Wgmma`] emulates an sm_90a device, whose backward takes the TMA and
    /// wgmma kernel where a launch can.
    pub fn with_backward_mma(self, mma: BackwardMma) -> Self {
        Emulator { backward: BackwardOptions { mma, ..self.backward }, ..self }
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
}
