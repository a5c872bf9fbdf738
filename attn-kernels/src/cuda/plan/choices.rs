//! The kernel shapes a CUDA device chooses between, each read once from an environment
//! variable when the device opens: the forward's block shape and pattern fusion, the
//! backward's query-tile loads and keys a block. Where a variable is unset, the device
//! takes the shapes measured fastest on its architecture (BENCHMARKS.md: sm_90), and on
//! architectures nobody has timed, the shapes that need the least shared memory.

use attn_core::{AttnError, Result};

/// The value of environment variable `var` parsed by `parse`, `unset` when unset; a value
/// `parse` refuses is a typed error naming what `expected` lists.
fn choice_from_env<T>(var: &str, parse: fn(&str) -> Option<T>, expected: &str, unset: T) -> Result<T> {
    match std::env::var(var) {
        Err(_) => Ok(unset),
        Ok(v) => {
            parse(&v).ok_or_else(|| AttnError::InvalidArgument(format!("{var} must be one of {expected}, got `{v}`")))
        }
    }
}

/// `ALL`, `name`, `parse` and `from_env` of a choice read from environment variable `$var`,
/// each value spelled as its string.
macro_rules! kernel_choice {
    ($ty:ident, $var:literal, { $($v:ident => $name:literal),+ $(,)? }) => {
        impl $ty {
            /// Every value.
            pub const ALL: [$ty; [$(stringify!($v)),+].len()] = [$($ty::$v),+];

            #[doc = concat!("The value as `", $var, "` spells it.")]
            pub fn name(self) -> &'static str {
                match self {
                    $($ty::$v => $name),+
                }
            }

            /// The value [`name`](Self::name) spells `s` (spaces around it ignored).
            pub fn parse(s: &str) -> Option<Self> {
                Self::ALL.into_iter().find(|c| c.name() == s.trim())
            }

            #[doc = concat!("The choice of `", $var, "`, `unset` when unset; an unknown value is a typed error.")]
            pub fn from_env_or(unset: Self) -> Result<Self> {
                choice_from_env($var, Self::parse, &Self::ALL.map(Self::name).join(", "), unset)
            }
        }
    };
}

/// Query rows (selected indices) per block of the tensor-core forward and how warps share
/// them: 64 over 4 warps, 128 over 8 warps (each K/V tile in shared memory serves twice
/// the rows; more shared memory a block), or 128 over 4 warps, 32 a warp (each K/V
/// fragment read from shared memory feeds two row tiles; twice the accumulator registers,
/// so head dims above 128 run the 64-row kernel). `ATTN_CUDA_FWD_ROWS=64|128|128w4`;
/// [`Default`] is 64, the least shared memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ForwardRows {
    #[default]
    M64,
    M128,
    M128W4,
}

kernel_choice!(ForwardRows, "ATTN_CUDA_FWD_ROWS", { M64 => "64", M128 => "128", M128W4 => "128w4" });

impl ForwardRows {
    /// Rows per block.
    pub fn rows(self) -> usize {
        match self {
            ForwardRows::M64 => 64,
            ForwardRows::M128 | ForwardRows::M128W4 => 128,
        }
    }

    /// Rows per warp (16 per row tile).
    pub fn rows_per_warp(self) -> usize {
        match self {
            ForwardRows::M64 | ForwardRows::M128 => 16,
            ForwardRows::M128W4 => 32,
        }
    }

    /// Threads per block.
    pub fn threads(self) -> u32 {
        (self.rows() / self.rows_per_warp() * 32) as u32
    }

    /// Whether the source has an instance for a padded head dim.
    pub fn has_head_dim(self, padded_d: usize) -> bool {
        self != ForwardRows::M128W4 || padded_d <= 128
    }
}

/// How the tensor-core forward launches the patterns of a call whose heads each have one
/// pattern (head groups): one launch per pattern, or `Fused`, the patterns (of disjoint
/// head ranges) in one launch of the 64-row fused kernel, up to
/// [`MAX_FUSED`](super::params::MAX_FUSED) a launch, the patterns with the most keys a
/// row first, so no launch ends with a partial wave of one pattern's blocks (128 rows a
/// block stay one launch a pattern), or `Persistent`, the same table of (pattern, head,
/// row block) items run by a grid sized to the machine (SM count times the blocks an SM
/// holds), each block taking items from an atomic counter, heaviest first.
/// `ATTN_CUDA_FWD_LAUNCH=per-pattern|fused|persistent`; [`Default`] is one launch a pattern.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PatternFusion {
    #[default]
    PerPattern,
    Fused,
    Persistent,
}

kernel_choice!(PatternFusion, "ATTN_CUDA_FWD_LAUNCH", {
    PerPattern => "per-pattern",
    Fused => "fused",
    Persistent => "persistent",
});

/// K/V stages of the tensor-core forward's key loop: `Two` (double buffering, two barriers
/// a key tile, the mask test per tile), or `Three` (`dilated_fwd_mma3.cu`: one barrier a
/// key tile with two tiles in flight, the full tiles found once per block, 32-bit index
/// math in the loop; the same key tiles, so the same bits; more shared memory a block, so
/// 128 rows a block at head dim 256 take the 64-row kernel).
/// `ATTN_CUDA_FWD_STAGES=2|3`; [`Default`] is two, the least shared memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ForwardStages {
    #[default]
    Two,
    Three,
}

kernel_choice!(ForwardStages, "ATTN_CUDA_FWD_STAGES", { Two => "2", Three => "3" });

impl ForwardStages {
    /// K/V tiles in shared memory.
    pub fn stages(self) -> usize {
        match self {
            ForwardStages::Two => 2,
            ForwardStages::Three => 3,
        }
    }
}

/// How the tensor-core backward loads its query tiles (Q, dO, lse, delta): `Sync`, each
/// tile before its compute, or `Pipelined`, by `cp.async` into two stages, the next tile
/// loading while this one computes (more shared memory a block). Both give the same bits.
/// `ATTN_CUDA_BWD_LOADS=sync|pipelined`; [`Default`] is sync, the least shared memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BackwardLoads {
    #[default]
    Sync,
    Pipelined,
}

kernel_choice!(BackwardLoads, "ATTN_CUDA_BWD_LOADS", { Sync => "sync", Pipelined => "pipelined" });

impl BackwardLoads {
    /// Query-tile stages in shared memory.
    pub fn stages(self) -> usize {
        match self {
            BackwardLoads::Sync => 1,
            BackwardLoads::Pipelined => 2,
        }
    }
}

/// Keys (selected indices) per block of the tensor-core backward: 64 over 4 warps, or 128
/// over 8 (FlashAttention-2's backward block: half the dQ atomics per key and query tile;
/// head dims from 64, smaller ones take 64 keys). `ATTN_CUDA_BWD_KEYS=64|128`; [`Default`]
/// is 64, the least shared memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BackwardKeys {
    #[default]
    K64,
    K128,
}

kernel_choice!(BackwardKeys, "ATTN_CUDA_BWD_KEYS", { K64 => "64", K128 => "128" });

impl BackwardKeys {
    /// Keys a block.
    pub fn keys(self) -> usize {
        match self {
            BackwardKeys::K64 => 64,
            BackwardKeys::K128 => 128,
        }
    }

    /// Threads a block (a warp per 16 keys).
    pub fn threads(self) -> u32 {
        (self.keys() / 16 * 32) as u32
    }

    /// Whether the source has an instance for a padded head dim.
    pub fn has_head_dim(self, padded_d: usize) -> bool {
        self == BackwardKeys::K64 || padded_d >= 64
    }
}

/// Query rows (selected indices) a tile of the tensor-core backward: 32, or 64 (half the
/// tiles a key block, so half the barriers, K/V fragment reloads and lse/delta loads, for
/// twice the S^T and dP^T registers and query-tile shared memory; the same sums in the
/// same order, so the same bits). `ATTN_CUDA_BWD_QUERIES=32|64`; [`Default`] is 32.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BackwardQueries {
    #[default]
    Q32,
    Q64,
}

kernel_choice!(BackwardQueries, "ATTN_CUDA_BWD_QUERIES", { Q32 => "32", Q64 => "64" });

impl BackwardQueries {
    /// Query rows a tile.
    pub fn rows(self) -> usize {
        match self {
            BackwardQueries::Q32 => 32,
            BackwardQueries::Q64 => 64,
        }
    }
}

/// How the backward sums dQ over key blocks: `Atomic`, each tensor-core block adding its
/// share with f32 atomics (the order blocks run in sets the rounding), or `Deterministic`,
/// the tensor-core kernel computing dK and dV only and a query-major tensor-core kernel
/// adding dQ (each query row one block's, its keys in index order), so two runs give the
/// same bits.
/// `ATTN_CUDA_BWD_DQ=atomic|deterministic`; [`Default`] is atomic. The row kernels (f32,
/// heads wider than 128) are deterministic either way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BackwardDq {
    #[default]
    Atomic,
    Deterministic,
}

kernel_choice!(BackwardDq, "ATTN_CUDA_BWD_DQ", { Atomic => "atomic", Deterministic => "deterministic" });

/// Where a whole call's backward writes its gradients: `Accumulated`, into f32
/// accumulators (zeroed first) that an epilogue converts to the gradients' dtype, or
/// `Direct`, straight from the tensor-core kernels in the gradients' dtype where a row has
/// one writer: dK and dV where every head has one pattern and there are as many key/value
/// heads as query heads, dQ where every head has one pattern under [`BackwardDq::Deterministic`]
/// (each gradient contiguous like its input; elsewhere the accumulators). No f32
/// accumulator, zero-fill or epilogue for them, the same bits.
/// `ATTN_CUDA_BWD_WRITES=accumulated|direct`; [`Default`] is accumulated (direct has not
/// been timed on a GPU yet).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BackwardWrites {
    #[default]
    Accumulated,
    Direct,
}

kernel_choice!(BackwardWrites, "ATTN_CUDA_BWD_WRITES", { Accumulated => "accumulated", Direct => "direct" });

/// Which tensor-core instructions the f16/bf16 forward runs: `MmaSync`, the `mma.sync`
/// kernels (every architecture), or `Wgmma`, the sm_90a forward (`dilated_fwd_wgmma.cu`:
/// TMA tiles through stride-r tensor maps, wgmma) for each launch it supports (head dims up
/// to 128, a pattern whose selected rows are one stride, 16-byte aligned rows, no block
/// mask; one launch a pattern), the `mma.sync` kernels for the others.
/// `ATTN_CUDA_FWD_MMA=mma-sync|wgmma`; unset, `mma-sync` everywhere (the sm_90a forward
/// has run only on the emulation); `wgmma` off sm_90 is refused when the device opens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ForwardMma {
    #[default]
    MmaSync,
    Wgmma,
}

kernel_choice!(ForwardMma, "ATTN_CUDA_FWD_MMA", { MmaSync => "mma-sync", Wgmma => "wgmma" });

/// Which instructions the f16/bf16 backward runs: `MmaSync`, the `mma.sync` kernels
/// (every architecture), or `Wgmma`, the sm_90a backward (`dilated_bwd_wgmma.cu`: TMA
/// tiles through stride-r tensor maps, wgmma, dK and dV in registers, dQ added a row at a
/// time by bulk reductions) for each launch it supports (head dims up to 128, a pattern
/// whose selected rows are one stride, 16-byte aligned rows, no block mask, dQ summed by
/// the key-major kernel: not [`BackwardDq::Deterministic`]), the `mma.sync` kernels for
/// the others. `ATTN_CUDA_BWD_MMA=mma-sync|wgmma`; unset, `mma-sync` everywhere (the sm_90a
/// backward has run only on the emulation); `wgmma` off sm_90 is refused when the device
/// opens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BackwardMma {
    #[default]
    MmaSync,
    Wgmma,
}

kernel_choice!(BackwardMma, "ATTN_CUDA_BWD_MMA", { MmaSync => "mma-sync", Wgmma => "wgmma" });

/// The tensor-core forward's choices: block shape, pattern fusion, K/V stages and the
/// instructions (where the sm_90a forward takes a launch, it replaces the other three).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ForwardOptions {
    pub rows: ForwardRows,
    pub fusion: PatternFusion,
    pub stages: ForwardStages,
    pub mma: ForwardMma,
}

impl ForwardOptions {
    /// The choices measured fastest on compute capability `cc`: on sm_90 (H100, H200) 128
    /// rows over 4 warps, one launch a pattern, `mma.sync` (the sm_90a forward waits for a
    /// GPU run); elsewhere (not timed) the [`Default`].
    pub fn measured_fastest(cc: (i32, i32)) -> Self {
        match cc {
            (9, 0) => ForwardOptions {
                rows: ForwardRows::M128W4,
                fusion: PatternFusion::PerPattern,
                stages: ForwardStages::Two,
                mma: ForwardMma::MmaSync,
            },
            _ => ForwardOptions::default(),
        }
    }

    /// `ATTN_CUDA_FWD_ROWS`, `ATTN_CUDA_FWD_LAUNCH`, `ATTN_CUDA_FWD_STAGES` and
    /// `ATTN_CUDA_FWD_MMA`, each unset one taken from `unset`.
    pub fn from_env_or(unset: Self) -> Result<Self> {
        Ok(ForwardOptions {
            rows: ForwardRows::from_env_or(unset.rows)?,
            fusion: PatternFusion::from_env_or(unset.fusion)?,
            stages: ForwardStages::from_env_or(unset.stages)?,
            mma: ForwardMma::from_env_or(unset.mma)?,
        })
    }

    /// Whether the source has a tensor-core instance of these rows and stages for a padded
    /// head dim (else the 64-row kernel of the same stages runs).
    pub fn has_head_dim(self, padded_d: usize) -> bool {
        match self.stages {
            ForwardStages::Two => self.rows.has_head_dim(padded_d),
            ForwardStages::Three => self.rows == ForwardRows::M64 || padded_d <= 128,
        }
    }
}

/// The tensor-core backward's choices: query-tile loads, keys a block, how dQ is summed,
/// where a whole call's dK and dV are written, and query rows a tile.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BackwardOptions {
    pub loads: BackwardLoads,
    pub keys: BackwardKeys,
    pub dq: BackwardDq,
    pub writes: BackwardWrites,
    pub queries: BackwardQueries,
    pub mma: BackwardMma,
}

impl BackwardOptions {
    /// The choices measured fastest on compute capability `cc`: on sm_90 (H100, H200) query
    /// tiles loaded in two stages and 128 keys a block; elsewhere (not timed) the
    /// [`Default`].
    pub fn measured_fastest(cc: (i32, i32)) -> Self {
        match cc {
            (9, 0) => {
                let (loads, keys) = (BackwardLoads::Pipelined, BackwardKeys::K128);
                BackwardOptions { loads, keys, ..BackwardOptions::default() }
            }
            _ => BackwardOptions::default(),
        }
    }

    /// `ATTN_CUDA_BWD_LOADS`, `ATTN_CUDA_BWD_KEYS`, `ATTN_CUDA_BWD_DQ`,
    /// `ATTN_CUDA_BWD_WRITES`, `ATTN_CUDA_BWD_QUERIES` and `ATTN_CUDA_BWD_MMA`, each unset
    /// one taken from `unset`.
    pub fn from_env_or(unset: Self) -> Result<Self> {
        Ok(BackwardOptions {
            loads: BackwardLoads::from_env_or(unset.loads)?,
            keys: BackwardKeys::from_env_or(unset.keys)?,
            dq: BackwardDq::from_env_or(unset.dq)?,
            writes: BackwardWrites::from_env_or(unset.writes)?,
            queries: BackwardQueries::from_env_or(unset.queries)?,
            mma: BackwardMma::from_env_or(unset.mma)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_choice_parses_from_its_name_and_nothing_else() {
        fn round_trip<T: Copy + PartialEq + std::fmt::Debug>(
            all: &[T],
            name: fn(T) -> &'static str,
            parse: fn(&str) -> Option<T>,
        ) {
            for &c in all {
                assert_eq!(parse(name(c)), Some(c));
                assert_eq!(parse(&format!(" {} ", name(c))), Some(c));
            }
            assert_eq!(parse("96"), None);
        }
        round_trip(&ForwardRows::ALL, ForwardRows::name, ForwardRows::parse);
        round_trip(&PatternFusion::ALL, PatternFusion::name, PatternFusion::parse);
        round_trip(&BackwardLoads::ALL, BackwardLoads::name, BackwardLoads::parse);
        round_trip(&BackwardKeys::ALL, BackwardKeys::name, BackwardKeys::parse);
        round_trip(&BackwardDq::ALL, BackwardDq::name, BackwardDq::parse);
        round_trip(&ForwardStages::ALL, ForwardStages::name, ForwardStages::parse);
        round_trip(&BackwardWrites::ALL, BackwardWrites::name, BackwardWrites::parse);
        round_trip(&BackwardQueries::ALL, BackwardQueries::name, BackwardQueries::parse);
        round_trip(&ForwardMma::ALL, ForwardMma::name, ForwardMma::parse);
        round_trip(&BackwardMma::ALL, BackwardMma::name, BackwardMma::parse);
        assert_eq!(ForwardRows::ALL.map(ForwardRows::name), ["64", "128", "128w4"]);
        assert_eq!(PatternFusion::ALL.map(PatternFusion::name), ["per-pattern", "fused", "persistent"]);
    }

    #[test]
    fn an_unknown_value_is_a_typed_error_that_lists_the_choices() {
        let e = choice_from_env("PATH", BackwardKeys::parse, "64, 128", BackwardKeys::K64).unwrap_err();
        assert!(matches!(e, AttnError::InvalidArgument(ref m) if m.contains("PATH must be one of 64, 128")), "{e}");
        for unset in BackwardKeys::ALL {
            assert_eq!(choice_from_env("ATTN_TEST_SURELY_UNSET_VAR", BackwardKeys::parse, "", unset).unwrap(), unset);
        }
    }

    #[test]
    fn sm_90_takes_its_measured_fastest_shapes_and_untimed_architectures_the_smallest() {
        let (fwd, bwd) = (ForwardOptions::measured_fastest((9, 0)), BackwardOptions::measured_fastest((9, 0)));
        assert_eq!(
            (fwd.rows, fwd.fusion, fwd.stages, fwd.mma),
            (ForwardRows::M128W4, PatternFusion::PerPattern, ForwardStages::Two, ForwardMma::MmaSync)
        );
        assert_eq!((bwd.loads, bwd.keys), (BackwardLoads::Pipelined, BackwardKeys::K128));
        for cc in [(8, 0), (8, 6), (8, 9), (10, 0), (12, 0)] {
            assert_eq!(ForwardOptions::measured_fastest(cc), ForwardOptions::default(), "sm_{}{}", cc.0, cc.1);
            assert_eq!(BackwardOptions::measured_fastest(cc), BackwardOptions::default(), "sm_{}{}", cc.0, cc.1);
        }
        let least = ForwardOptions {
            rows: ForwardRows::M64,
            fusion: PatternFusion::PerPattern,
            stages: ForwardStages::Two,
            mma: ForwardMma::MmaSync,
        };
        assert_eq!(ForwardOptions::default(), least);
        let least = BackwardOptions {
            loads: BackwardLoads::Sync,
            keys: BackwardKeys::K64,
            dq: BackwardDq::Atomic,
            writes: BackwardWrites::Accumulated,
            queries: BackwardQueries::Q32,
            mma: BackwardMma::MmaSync,
        };
        assert_eq!(BackwardOptions::default(), least);
    }
}
