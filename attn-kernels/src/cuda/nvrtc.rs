//! NVRTC compilation of the kernel source for one device: a cubin for the device's own
//! architecture (`--gpu-architecture=sm_XX`), so no driver JIT runs at load, and PTX for
//! its virtual architecture only where NVRTC cannot emit that cubin.
#![allow(unsafe_code)]

use std::ffi::{CString, c_char};

use attn_core::{AttnError, Result};
use cudarc::nvrtc::{CompileOptions, Ptx, compile_ptx_with_opts, result, sys};

use super::source::nvrtc_options;

/// What [`compile_for_device`] produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageKind {
    /// Machine code for the device's architecture.
    Cubin,
    /// PTX, compiled by the driver at load (NVRTC could not emit the cubin).
    Ptx,
}

/// Compile `src` with `extra` options for compute capability `cc`: the cubin for
/// `sm_XX`, else PTX for `compute_XX`. The error names both failures.
pub fn compile_for_device(src: &str, cc: (i32, i32), extra: &[String]) -> Result<(Ptx, ImageKind)> {
    let with =
        |arch: String| -> Vec<String> { nvrtc_options(&arch).into_iter().chain(extra.iter().cloned()).collect() };
    match compile_cubin(src, &with(format!("sm_{}{}", cc.0, cc.1))) {
        Ok(cubin) => Ok((Ptx::from_binary(cubin), ImageKind::Cubin)),
        Err(cubin_err) => {
            let opts = CompileOptions { options: with(format!("compute_{}{}", cc.0, cc.1)), ..Default::default() };
            match compile_ptx_with_opts(src, opts) {
                Ok(ptx) => Ok((ptx, ImageKind::Ptx)),
                Err(ptx_err) => Err(AttnError::backend(
                    "cuda",
                    std::io::Error::other(format!("NVRTC: cubin: {cubin_err}; PTX: {ptx_err}")),
                )),
            }
        }
    }
}

/// The program handle, destroyed on drop.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the handle came from `create_program` and is destroyed once, here.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

/// Compile `src` with `options` (a real architecture among them) and return the cubin.
pub fn compile_cubin(src: &str, options: &[String]) -> Result<Vec<u8>> {
    let err = |what: &str, e: &dyn std::fmt::Debug| {
        AttnError::backend("cuda", std::io::Error::other(format!("{what}: {e:?}")))
    };
    let csrc = CString::new(src).map_err(|e| err("kernel source", &e))?;
    let prog = Program(result::create_program(&csrc, None).map_err(|e| err("nvrtcCreateProgram", &e))?);
    // SAFETY: `prog.0` is a live program created above.
    if let Err(e) = unsafe { result::compile_program(prog.0, options) } {
        // SAFETY: as above; the log is a NUL-terminated buffer NVRTC filled.
        let log = unsafe { result::get_program_log(prog.0) }
            .map(|l| l.iter().take_while(|&&c| c != 0).map(|&c| c as u8 as char).collect::<String>())
            .unwrap_or_default();
        return Err(err("nvrtcCompileProgram", &format!("{e:?}: {log}")));
    }
    let mut size = 0usize;
    // SAFETY: `prog.0` compiled successfully; `size` is a valid out-pointer.
    unsafe { sys::nvrtcGetCUBINSize(prog.0, &mut size) }.result().map_err(|e| err("nvrtcGetCUBINSize", &e))?;
    if size == 0 {
        return Err(err("nvrtcGetCUBIN", &"no cubin (a virtual architecture was given)"));
    }
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` holds the `size` bytes NVRTC reported for this program.
    unsafe { sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr().cast::<c_char>()) }
        .result()
        .map_err(|e| err("nvrtcGetCUBIN", &e))?;
    Ok(cubin)
}
