//! A compiled module image, the value NVRTC produces and the kernel cache keeps: a cubin
//! for the device's architecture, or PTX for the driver to compile at load.

use cudarc::nvrtc::Ptx;

/// What `compile_for_device` produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageKind {
    /// Machine code for the device's architecture.
    Cubin,
    /// PTX, compiled by the driver at load (NVRTC could not emit the cubin).
    Ptx,
}

/// A module image: a cubin, or PTX text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelImage {
    pub bytes: Vec<u8>,
    pub kind: ImageKind,
}

impl KernelImage {
    /// The image as the driver loads it.
    pub fn to_ptx(&self) -> Ptx {
        match self.kind {
            ImageKind::Cubin => Ptx::from_binary(self.bytes.clone()),
            ImageKind::Ptx => Ptx::from_src(String::from_utf8_lossy(&self.bytes).into_owned()),
        }
    }
}
