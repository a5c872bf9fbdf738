//! NVRTC compilation of the kernel source for one device: a cubin for the device's own
//! architecture (`--gpu-architecture=sm_XX`), so no driver JIT runs at load, and PTX for
//! the newest virtual architecture NVRTC knows up to the device's only where NVRTC cannot
//! emit that cubin; through the kernel cache on disk where one is given.
#![allow(unsafe_code)]

use std::ffi::{CString, c_char};
use std::sync::OnceLock;

use attn_core::{AttnError, Result};

pub use super::image::{ImageKind, KernelImage};
use super::kernel_cache::{KernelCache, image_key};
use super::nvrtc_library::{BytesFn, NvrtcLibrary, Program, SizeFn, nvrtc_library};
use super::slots::Slots;
use crate::cuda::plan::source::nvrtc_options;

/// Whether a compile turns on its architecture's specific features (the `a` targets:
/// sm_90a's TMA, mbarrier transactions and wgmma), whose code runs on that compute
/// capability only.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum ArchFeatures {
    #[default]
    Portable,
    Specific,
}

/// What a module is compiled for: a compute capability and its [`ArchFeatures`]; a
/// `(major, minor)` pair is the portable target of that capability.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target {
    pub cc: (i32, i32),
    pub features: ArchFeatures,
}

impl From<(i32, i32)> for Target {
    fn from(cc: (i32, i32)) -> Self {
        Target { cc, features: ArchFeatures::Portable }
    }
}

impl Target {
    /// The architecture's digits and suffix: `90`, or `90a` with its specific features.
    pub fn arch(self) -> String {
        let suffix = match self.features {
            ArchFeatures::Portable => "",
            ArchFeatures::Specific => "a",
        };
        format!("{}{}{suffix}", self.cc.0, self.cc.1)
    }
}

/// The options of the cubin compile for `target` with `extra`.
fn cubin_options(target: Target, extra: &[String]) -> Vec<String> {
    with_arch(format!("sm_{}", target.arch()), extra)
}

fn with_arch(arch: String, extra: &[String]) -> Vec<String> {
    nvrtc_options(&arch).into_iter().chain(extra.iter().cloned()).collect()
}

/// The virtual architecture of the PTX fallback for a device of `cc`: the newest one
/// `supported` (NVRTC's list, `10 * major + minor`) not newer than the device, which the
/// driver compiles for the device at load; the device's own where the list is unknown.
pub fn ptx_arch(cc: (i32, i32), supported: Option<&[i32]>) -> Option<i32> {
    let device = 10 * cc.0 + cc.1;
    match supported {
        Some(archs) => archs.iter().copied().filter(|&a| a <= device).max(),
        None => Some(device),
    }
}

/// Compile `src` with `extra` options for compute capability `cc`: the cubin for
/// `sm_XX`, else PTX for the newest virtual architecture NVRTC knows that the device
/// runs (a device newer than NVRTC gets PTX the driver compiles). The error names both
/// failures.
pub fn compile_for_device(src: &str, target: impl Into<Target>, extra: &[String]) -> Result<KernelImage> {
    let target = target.into();
    let cc = target.cc;
    let cubin_err = match compile_cubin(src, &cubin_options(target, extra)) {
        Ok(bytes) => return Ok(KernelImage { bytes, kind: ImageKind::Cubin }),
        Err(e) => e,
    };
    let supported = nvrtc_library()?.supported_archs();
    // Architecture-specific code has PTX for its own architecture only.
    let arch = match target.features {
        ArchFeatures::Portable => ptx_arch(cc, supported.as_deref()).map(|a| a.to_string()),
        ArchFeatures::Specific => Some(target.arch()),
    };
    let ptx_err = match arch {
        Some(arch) => match compile_ptx(src, &with_arch(format!("compute_{arch}"), extra)) {
            Ok(ptx) => return Ok(KernelImage { bytes: ptx.into_bytes(), kind: ImageKind::Ptx }),
            Err(e) => e.to_string(),
        },
        None => format!("this NVRTC supports no architecture up to sm_{}{} (it supports {supported:?})", cc.0, cc.1),
    };
    Err(AttnError::backend("cuda", std::io::Error::other(format!("NVRTC: cubin: {cubin_err}; PTX: {ptx_err}"))))
}

/// Where [`image_for_device`] or [`process_image`] found its image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageSource {
    /// Compiled earlier in this process (another device of the same architecture).
    Process,
    /// Read from the kernel cache.
    Cache,
    /// Compiled by NVRTC (and kept in the cache where one is given and writable).
    Nvrtc,
}

/// The images compiled or read in this process, by key.
fn process_images() -> &'static Slots<Vec<u8>, KernelImage> {
    static IMAGES: OnceLock<Slots<Vec<u8>, KernelImage>> = OnceLock::new();
    IMAGES.get_or_init(Slots::new)
}

/// [`image_for_device`] kept for the process by its key, so that a second device of one
/// architecture neither compiles nor reads the disk again (a cache that cannot be written,
/// or none, would otherwise cost every device a compile). Callers wanting the same image
/// wait for one compile; others do not wait.
pub fn process_image(
    src: &str,
    cc: impl Into<Target>,
    extra: &[String],
    cache: Option<&KernelCache>,
) -> Result<(KernelImage, ImageSource)> {
    let cc = cc.into();
    let mut from = ImageSource::Process;
    let (image, _) = process_images().get_or_make(device_image_key(src, cc, extra)?, || {
        image_for_device(src, cc, extra, cache).map(|(image, source)| {
            from = source;
            image
        })
    })?;
    Ok((image, from))
}

/// [`compile_into`], the image then also the process's in place of what it held (a
/// recompile of an image the driver refused).
pub fn recompile_for_process(
    src: &str,
    cc: impl Into<Target>,
    extra: &[String],
    cache: Option<&KernelCache>,
) -> Result<KernelImage> {
    let cc = cc.into();
    let image = compile_into(src, cc, extra, cache)?;
    process_images().replace(device_image_key(src, cc, extra)?, image.clone());
    Ok(image)
}

/// [`compile_for_device`] through `cache`: the image kept there for this NVRTC version,
/// these options and this source, else compiled and kept (a cache that cannot be written
/// costs the next process a compile, nothing more).
pub fn image_for_device(
    src: &str,
    cc: impl Into<Target>,
    extra: &[String],
    cache: Option<&KernelCache>,
) -> Result<(KernelImage, ImageSource)> {
    let cc = cc.into();
    if let Some(cache) = cache
        && let Some((bytes, kind)) = cache.get(&device_image_key(src, cc, extra)?)
    {
        return Ok((KernelImage { bytes, kind }, ImageSource::Cache));
    }
    Ok((compile_into(src, cc, extra, cache)?, ImageSource::Nvrtc))
}

/// [`compile_for_device`], the image then kept in `cache` in place of what it held.
pub fn compile_into(
    src: &str,
    cc: impl Into<Target>,
    extra: &[String],
    cache: Option<&KernelCache>,
) -> Result<KernelImage> {
    let cc = cc.into();
    let image = compile_for_device(src, cc, extra)?;
    if let Some(cache) = cache {
        let _ = cache.put(&device_image_key(src, cc, extra)?, &image.bytes, image.kind);
    }
    Ok(image)
}

/// The kernel cache's key of the image of `src` for `cc` with `extra`.
fn device_image_key(src: &str, cc: Target, extra: &[String]) -> Result<Vec<u8>> {
    Ok(image_key(nvrtc_library()?.version(), &cubin_options(cc, extra), src))
}

/// Compile `src` with `options` (a real architecture among them) and return the cubin.
pub fn compile_cubin(src: &str, options: &[String]) -> Result<Vec<u8>> {
    nvrtc_library()?.compile(src, options, Output::Cubin)
}

/// Compile `src` with `options` (a virtual architecture among them) and return the PTX.
pub fn compile_ptx(src: &str, options: &[String]) -> Result<String> {
    let mut ptx = nvrtc_library()?.compile(src, options, Output::Ptx)?;
    ptx.truncate(ptx.iter().position(|&b| b == 0).unwrap_or(ptx.len()));
    String::from_utf8(ptx).map_err(|e| nvrtc_err("nvrtcGetPTX", &e.to_string()))
}

/// Which image a compilation returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// Machine code (needs a real architecture, `sm_XX`).
    Cubin,
    /// PTX text with its NUL terminator.
    Ptx,
}

fn nvrtc_err(what: &str, detail: &str) -> AttnError {
    AttnError::backend("cuda", std::io::Error::other(format!("{what}: {detail}")))
}

/// A program handle, destroyed on drop.
struct ProgramHandle<'a>(&'a NvrtcLibrary, Program);

impl Drop for ProgramHandle<'_> {
    fn drop(&mut self) {
        // SAFETY: the handle came from nvrtcCreateProgram and is destroyed once, here.
        let _ = unsafe { (self.0.destroy)(&mut self.1) };
    }
}

impl NvrtcLibrary {
    /// Compile `src` with `options` and return the `output` image.
    pub fn compile(&self, src: &str, options: &[String], output: Output) -> Result<Vec<u8>> {
        let csrc = CString::new(src).map_err(|e| nvrtc_err("kernel source", &e.to_string()))?;
        let copts: Vec<CString> = options
            .iter()
            .map(|o| CString::new(o.as_str()))
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| nvrtc_err("NVRTC option", &e.to_string()))?;
        let ptrs: Vec<*const c_char> = copts.iter().map(|o| o.as_ptr()).collect();
        let mut raw: Program = std::ptr::null_mut();
        let none = std::ptr::null();
        // SAFETY: `raw` is a valid out-pointer and `csrc` a NUL-terminated source; no
        // headers are given (count 0, null arrays), which NVRTC allows.
        let status = unsafe { (self.create)(&mut raw, csrc.as_ptr(), std::ptr::null(), 0, none, none) };
        self.check("nvrtcCreateProgram", status).map_err(|e| nvrtc_err("NVRTC", &e))?;
        let prog = ProgramHandle(self, raw);
        let count = i32::try_from(ptrs.len()).map_err(|e| nvrtc_err("NVRTC options", &e.to_string()))?;
        // SAFETY: `prog.1` is live; `ptrs` holds `count` NUL-terminated strings alive here.
        let status = unsafe { (self.compile)(prog.1, count, ptrs.as_ptr()) };
        if let Err(e) = self.check("nvrtcCompileProgram", status) {
            let log = self.read(prog.1, self.log_size, self.log).unwrap_or_default();
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            return Err(nvrtc_err("NVRTC", &format!("{e}: {}", String::from_utf8_lossy(&log[..end]))));
        }
        let (size, bytes, what) = match output {
            Output::Cubin => (self.cubin_size, self.cubin, "nvrtcGetCUBIN"),
            Output::Ptx => (self.ptx_size, self.ptx, "nvrtcGetPTX"),
        };
        let image = self.read(prog.1, size, bytes).map_err(|e| nvrtc_err(what, &e))?;
        if image.is_empty() {
            return Err(nvrtc_err(what, "no image (a cubin needs a real architecture, sm_XX)"));
        }
        Ok(image)
    }

    /// A buffer NVRTC sizes with `size` and fills with `bytes`.
    fn read(&self, prog: Program, size: SizeFn, bytes: BytesFn) -> std::result::Result<Vec<u8>, String> {
        let mut n = 0usize;
        // SAFETY: `prog` is a live program and `n` a valid out-pointer.
        self.check("size query", unsafe { size(prog, &mut n) })?;
        let mut buf = vec![0u8; n];
        if n > 0 {
            // SAFETY: `buf` holds the `n` bytes NVRTC reported for this program.
            self.check("read", unsafe { bytes(prog, buf.as_mut_ptr().cast::<c_char>()) })?;
        }
        Ok(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::ptx_arch;

    #[test]
    fn the_ptx_fallback_is_the_newest_known_architecture_the_device_runs() {
        let known = [75, 80, 86, 89, 90, 100, 120];
        assert_eq!(ptx_arch((12, 1), Some(&known)), Some(120));
        assert_eq!(ptx_arch((13, 0), Some(&known)), Some(120));
        assert_eq!(ptx_arch((10, 3), Some(&known)), Some(100));
        assert_eq!(ptx_arch((9, 0), Some(&known)), Some(90));
        assert_eq!(ptx_arch((7, 0), Some(&known)), None);
        assert_eq!(ptx_arch((9, 0), None), Some(90));
    }
}
