//! Which instruction set the tile kernels use, detected once at run time.

use std::sync::OnceLock;

use crate::cpu::isa::cpu_features;

/// The kernel flavour: AMX-BF16 + AVX-512, AVX512-BF16 + AVX-512, AVX-512, AVX2+FMA
/// (x86-64, detected at run time) or portable Rust.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Plain Rust loops; compiles and runs everywhere.
    Portable,
    /// AVX2+FMA kernels (x86-64 only, chosen when the CPU has avx2 and fma but no avx512f).
    Avx2,
    /// AVX-512F FMA kernels (x86-64 only, chosen when the CPU has avx512f).
    Avx512,
    /// The AVX-512 kernels, plus AVX512-BF16 dot products (`vdpbf16ps`) for the bf16
    /// forward's `q·kᵀ` and `p·v` (x86-64 with avx512f and avx512bf16). Chosen on AMD
    /// (Zen 4 and later); Intel cores without AMX get [`Isa::Avx512`], whose f32 kernel on
    /// converted bf16 rows is faster there (`ATTN_CPU_ISA=avx512bf16` still selects it).
    Avx512Bf16,
    /// The AVX-512 kernels, plus AMX-BF16 tile products for the bf16 forward (x86-64
    /// Linux with AMX-TILE and AMX-BF16, once the OS grants the tile state).
    Amx,
}

impl Isa {
    /// The flavour to use, chosen once and cached: `ATTN_CPU_ISA=portable|avx2|avx512|avx512bf16|amx` if
    /// set and supported, else [`Isa::best`].
    pub fn detect() -> Isa {
        static DETECTED: OnceLock<Isa> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            let forced = std::env::var("ATTN_CPU_ISA").ok().and_then(|s| Isa::parse(&s)).filter(|i| i.is_supported());
            forced.unwrap_or_else(Isa::best)
        })
    }

    /// The best flavour this CPU supports: the first of [`Isa::ALL`] it runs and gains from.
    pub fn best() -> Isa {
        Isa::ALL.into_iter().find(|i| i.is_supported() && i.pays()).unwrap_or(Isa::Portable)
    }

    /// Whether the flavour is faster than the next one down where both run: AVX512-BF16
    /// only where `vdpbf16ps` issues at the FMA rate (AMD).
    fn pays(self) -> bool {
        self != Isa::Avx512Bf16 || cpu_features::bf16_dot_full_rate()
    }

    /// Parse `portable`, `avx2`, `avx512`, `avx512bf16` or `amx`.
    pub fn parse(s: &str) -> Option<Isa> {
        Isa::ALL.into_iter().find(|i| i.as_str().eq_ignore_ascii_case(s.trim()))
    }

    /// Whether this CPU can run the flavour.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Portable => true,
            Isa::Avx2 => cpu_features::avx2_fma(),
            Isa::Avx512 => cpu_features::avx512f(),
            Isa::Avx512Bf16 => cpu_features::avx512_bf16(),
            Isa::Amx => cpu_features::amx_bf16(),
        }
    }

    /// All flavours, best first.
    pub const ALL: [Isa; 5] = [Isa::Amx, Isa::Avx512Bf16, Isa::Avx512, Isa::Avx2, Isa::Portable];

    pub fn as_str(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Avx512Bf16 => "avx512bf16",
            Isa::Amx => "amx",
        }
    }
}
