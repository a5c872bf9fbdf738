//! The kernel source compiles with NVRTC for sm_80 and sm_90 when libnvrtc is loadable
//! (e.g. `LD_LIBRARY_PATH=~/.cache/attn-cuda/nvidia/cuda_nvrtc/lib`), and NVRTC 12 and 13
//! open from their directories alone. It skips without NVRTC only where nothing promises
//! it: with `ATTN_CUDA_HOME` set (CI installs the CUDA 12 wheel there and the CUDA 13 one
//! under `cu13/`) or `ATTN_REQUIRE_GPU=1`, an NVRTC that does not load is a failure.
//! `cargo xtask ptx` goes further (ptxas registers and spills).
#![cfg(feature = "cuda")]

use std::path::PathBuf;

use attn_kernels::cuda::kernel_cache::KernelCache;
use attn_kernels::cuda::nvrtc::{
    ImageKind, ImageSource, Output, compile_cubin, compile_for_device, compile_ptx, image_for_device, process_image,
    recompile_for_process,
};
use attn_kernels::cuda::source::{dtype_define, full_source, kernel_names, nvrtc_options};
use attn_kernels::cuda::{LibrarySearch, library_files_in, nvrtc_library, nvrtc_search, open_nvrtc};
use attn_testkit::skip_gpu_test;

/// Whether NVRTC loads; its absence is a skip only where nothing promises it.
fn nvrtc_or_skip(test: &str) -> bool {
    if let Err(e) = nvrtc_library() {
        let reason = e.to_string();
        if let Some(home) = std::env::var_os("ATTN_CUDA_HOME") {
            panic!("ATTN_CUDA_HOME={} is set but {reason}", home.to_string_lossy());
        }
        skip_gpu_test(test, reason);
        return false;
    }
    true
}

#[test]
fn kernels_compile_for_sm80_and_sm90() {
    if !nvrtc_or_skip("kernels_compile_for_sm80_and_sm90") {
        return;
    }
    for arch in ["compute_80", "compute_90"] {
        let ptx = compile_ptx(&full_source(), &nvrtc_options(arch)).unwrap_or_else(|e| panic!("{arch}: {e}"));
        for name in kernel_names() {
            assert!(ptx.contains(&format!(".entry {name}(")), "{arch}: {name} missing from the PTX");
        }
    }
}

/// A device's module is a cubin for its own architecture (an ELF image), one dtype per
/// module; an architecture NVRTC does not know is an error naming both attempts.
#[test]
fn device_modules_are_cubins_for_the_device_architecture() {
    if !nvrtc_or_skip("device_modules_are_cubins_for_the_device_architecture") {
        return;
    }
    let image = compile_for_device(&full_source(), (9, 0), &[dtype_define("f32").unwrap()]).unwrap();
    assert_eq!(image.kind, ImageKind::Cubin, "sm_90");
    // The f32 module: a cubin's format does not depend on the dtype, and the f16/bf16
    // modules (every tensor-core kernel) take a minute each; `cargo xtask ptx` assembles them.
    let options: Vec<String> = nvrtc_options("sm_80").into_iter().chain([dtype_define("f32").unwrap()]).collect();
    let cubin = compile_cubin(&full_source(), &options).unwrap();
    assert!(cubin.len() > 1024 && cubin.starts_with(b"\x7fELF"), "sm_80: not a cubin");
    let err = compile_for_device(&full_source(), (1, 0), &[]).unwrap_err().to_string();
    assert!(err.contains("cubin") && err.contains("PTX"), "{err}");
}

/// A device newer than NVRTC (no cubin for its architecture) gets PTX for the newest
/// virtual architecture NVRTC knows, which the driver compiles at load.
#[test]
fn a_device_newer_than_nvrtc_gets_ptx_of_the_newest_known_architecture() {
    if !nvrtc_or_skip("a_device_newer_than_nvrtc_gets_ptx_of_the_newest_known_architecture") {
        return;
    }
    let archs = nvrtc_library().unwrap().supported_archs().expect("NVRTC 12 and 13 list their architectures");
    let newest = *archs.last().unwrap();
    assert!(archs.contains(&80) && newest >= 90, "{archs:?}");
    let src = "extern \"C\" __global__ void touch(float* x) { x[0] = 1.0f; }";
    let image = compile_for_device(src, (99, 9), &[]).unwrap();
    assert_eq!(image.kind, ImageKind::Ptx);
    let ptx = String::from_utf8(image.bytes).unwrap();
    assert!(ptx.contains(&format!(".target sm_{newest}")), "{ptx}");
}

/// A module is compiled once per process: a second device of the same architecture gets
/// the first one's image (no cache on disk here); another architecture compiles.
#[test]
fn a_process_compiles_each_module_once() {
    if !nvrtc_or_skip("a_process_compiles_each_module_once") {
        return;
    }
    let src = "extern \"C\" __global__ void once(float* x) { x[0] = 2.0f; }";
    let (first, from) = process_image(src, (9, 0), &[], None).unwrap();
    assert_eq!(from, ImageSource::Nvrtc);
    let (again, from) = process_image(src, (9, 0), &[], None).unwrap();
    assert_eq!((from, &again), (ImageSource::Process, &first));
    let (other, from) = process_image(src, (8, 0), &[], None).unwrap();
    assert_eq!(from, ImageSource::Nvrtc, "sm_80 took sm_90's image");
    assert_ne!(other, first);
    // A recompile (of an image the driver refused) stays the process's image.
    let fresh = recompile_for_process(src, (9, 0), &[], None).unwrap();
    assert_eq!(fresh.kind, ImageKind::Cubin);
    assert_eq!(process_image(src, (9, 0), &[], None).unwrap(), (fresh, ImageSource::Process));
}

/// A module compiled once is read back from the kernel cache, byte for byte, by the next
/// call with the same NVRTC, options and source; another dtype or architecture compiles
/// again; without a cache every call compiles.
#[test]
fn device_modules_are_kept_in_the_kernel_cache() {
    if !nvrtc_or_skip("device_modules_are_kept_in_the_kernel_cache") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("attn-kernel-cache-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cache = KernelCache::at(&dir);
    let (src, f32_only) = (full_source(), [dtype_define("f32").unwrap()]);
    let (first, from) = image_for_device(&src, (9, 0), &f32_only, Some(&cache)).unwrap();
    assert_eq!((from, first.kind), (ImageSource::Nvrtc, ImageKind::Cubin));
    let (again, from) = image_for_device(&src, (9, 0), &f32_only, Some(&cache)).unwrap();
    assert_eq!(from, ImageSource::Cache);
    assert_eq!(again, first, "the kept image differs from the compiled one");
    let (_, from) = image_for_device(&src, (8, 0), &f32_only, Some(&cache)).unwrap();
    assert_eq!(from, ImageSource::Nvrtc, "sm_80 read sm_90's image");
    let (_, from) = image_for_device(&src, (8, 0), &f32_only, Some(&cache)).unwrap();
    assert_eq!(from, ImageSource::Cache);
    let (_, from) = image_for_device(&src, (9, 0), &f32_only, None).unwrap();
    assert_eq!(from, ImageSource::Nvrtc);
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 2, "one file an image");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The directories holding an NVRTC to open by path: under `ATTN_CUDA_HOME` the CUDA 12
/// wheel and the CUDA 13 one (both required), else the CUDA toolkit's directories.
fn nvrtc_dirs() -> Vec<PathBuf> {
    match std::env::var_os("ATTN_CUDA_HOME").map(PathBuf::from) {
        Some(home) => {
            let dirs = [home.join("nvidia/cuda_nvrtc/lib"), home.join("cu13/nvidia/cu13/lib")];
            for d in &dirs {
                assert!(
                    !library_files_in(d, "libnvrtc").is_empty(),
                    "ATTN_CUDA_HOME is set but {} holds no libnvrtc",
                    d.display()
                );
            }
            dirs.into()
        }
        None => {
            nvrtc_search().dirs.into_iter().filter(|d| !library_files_in(d, "libnvrtc").is_empty()).take(1).collect()
        }
    }
}

/// NVRTC opens from its directory with no linker name: the lookup a Python package's
/// added directories and the CUDA toolkit's take. NVRTC 13 opens its builtins library by
/// name when it compiles; the copy beside it must be found without `LD_LIBRARY_PATH`, so
/// each one compiles a kernel module to a cubin.
#[test]
fn nvrtc_opens_from_its_directory_and_compiles() {
    let dirs = nvrtc_dirs();
    if dirs.is_empty() {
        skip_gpu_test("nvrtc_opens_from_its_directory_and_compiles", "no NVRTC in the CUDA toolkit's directories");
        return;
    }
    for dir in dirs {
        let search =
            LibrarySearch { explicit: None, linker_names: Vec::new(), dirs: vec![dir.clone()], ..nvrtc_search() };
        let lib = open_nvrtc(&search).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        assert!(lib.path().starts_with(dir.to_str().unwrap()), "{} opened {}", dir.display(), lib.path());
        let options: Vec<String> = nvrtc_options("sm_90").into_iter().chain([dtype_define("f32").unwrap()]).collect();
        let cubin = lib
            .compile(&full_source(), &options, Output::Cubin)
            .unwrap_or_else(|e| panic!("NVRTC {:?} from {}: {e}", lib.version(), lib.path()));
        assert!(cubin.starts_with(b"\x7fELF"), "NVRTC {:?}: not a cubin", lib.version());
    }
}
