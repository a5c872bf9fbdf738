//! Which instruction set the tile kernels use, detected once at run time.

use std::sync::OnceLock;

/// The kernel flavour: AVX-512 (x86-64 with avx512f) or the portable Rust fallback.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Plain Rust loops; compiles and runs everywhere.
    Portable,
    /// AVX-512F FMA kernels (x86-64 only, chosen when the CPU has avx512f).
    Avx512,
}

impl Isa {
    /// The best flavour this CPU supports (detected once, then cached).
    pub fn detect() -> Isa {
        static DETECTED: OnceLock<Isa> = OnceLock::new();
        *DETECTED.get_or_init(|| if Isa::Avx512.is_supported() { Isa::Avx512 } else { Isa::Portable })
    }

    /// Whether this CPU can run the flavour.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Portable => true,
            Isa::Avx512 => avx512_supported(),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx512 => "avx512",
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn avx512_supported() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx512_supported() -> bool {
    false
}
