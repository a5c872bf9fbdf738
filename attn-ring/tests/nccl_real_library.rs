//! A real libnccl opens from its directory alone (the lookup that finds PyTorch's and
//! NCCL's own `libnccl.so.2`, which cudarc's does not) and runs the calls that need no GPU:
//! its version and unique ids. CI installs the `nvidia-nccl-cu12` wheel under
//! `ATTN_CUDA_HOME/nccl`; there a library that does not open is a failure. Elsewhere the
//! process's own lookup is used, and finding no NCCL is a skip with the reason.
#![cfg(all(feature = "nccl", target_os = "linux"))]

use std::path::PathBuf;

use attn_kernels::cuda::{LibrarySearch, library_files_in};
use attn_ring::comm::nccl_library::{NcclLibrary, nccl_search, open_nccl};

/// The wheel's NCCL, or the one this machine's lookup finds; `None` (skip) when neither.
fn real_nccl() -> Option<NcclLibrary> {
    match std::env::var_os("ATTN_CUDA_HOME").map(PathBuf::from) {
        Some(home) => {
            let dir = home.join("nccl/nvidia/nccl/lib");
            assert!(
                !library_files_in(&dir, "libnccl").is_empty(),
                "ATTN_CUDA_HOME is set but {} has no libnccl",
                dir.display()
            );
            let search =
                LibrarySearch { explicit: None, linker_names: Vec::new(), dirs: vec![dir.clone()], ..nccl_search() };
            let lib = open_nccl(&search).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
            assert!(lib.path().starts_with(dir.to_str().unwrap()), "{} opened {}", dir.display(), lib.path());
            Some(lib)
        }
        None => match open_nccl(&nccl_search()) {
            Ok(lib) => Some(lib),
            Err(e) => {
                println!("skipped: no NCCL here ({e})");
                None
            }
        },
    }
}

#[test]
fn a_real_libnccl_opens_and_makes_unique_ids() {
    let Some(lib) = real_nccl() else { return };
    println!("NCCL {} from {}", lib.version(), lib.path());
    assert!(lib.version() >= 21700, "NCCL {} is older than 2.17 (non-blocking communicators)", lib.version());
    let a = lib.unique_id().unwrap();
    let b = lib.unique_id().unwrap();
    assert!(a.iter().any(|&x| x != 0), "an all-zero unique id");
    assert_ne!(a, b, "two unique ids are the same");
}
