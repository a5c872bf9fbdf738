//! Finding and opening libnvrtc for CUDA 12 and 13 alike: the file `ATTN_NVRTC_PATH` names,
//! else the versioned and plain names through the dynamic linker, else the CUDA toolkit's
//! directories and those a caller adds (a Python package adds PyTorch's NVIDIA wheels).
//! cudarc's own lookup knows only the names of the CUDA version it was built for.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use attn_core::{AttnError, Result};
use libloading::Library;

/// The environment variable naming libnvrtc's file. When it is set, nothing else is tried.
pub const NVRTC_PATH_ENV: &str = "ATTN_NVRTC_PATH";

/// The names given to the dynamic linker, newest CUDA first; a library the process has
/// already loaded under one of them is reused.
const LINKER_NAMES: [&str; 3] = ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"];

/// NVRTC's program handle.
pub(crate) type Program = *mut c_void;

/// NVRTC's status code (`NVRTC_SUCCESS` is 0); an integer, so a code newer than these
/// bindings is still a value and never undefined behaviour.
type Status = c_int;

type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> Status;
type CreateFn = unsafe extern "C" fn(
    *mut Program,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> Status;
type DestroyFn = unsafe extern "C" fn(*mut Program) -> Status;
type CompileFn = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> Status;
pub(crate) type SizeFn = unsafe extern "C" fn(Program, *mut usize) -> Status;
pub(crate) type BytesFn = unsafe extern "C" fn(Program, *mut c_char) -> Status;
type ErrorStringFn = unsafe extern "C" fn(Status) -> *const c_char;

/// An opened libnvrtc: the functions this crate calls, its file and its version.
pub struct NvrtcLibrary {
    pub(crate) create: CreateFn,
    pub(crate) destroy: DestroyFn,
    pub(crate) compile: CompileFn,
    pub(crate) log_size: SizeFn,
    pub(crate) log: BytesFn,
    pub(crate) ptx_size: SizeFn,
    pub(crate) ptx: BytesFn,
    pub(crate) cubin_size: SizeFn,
    pub(crate) cubin: BytesFn,
    error_string: ErrorStringFn,
    version: (i32, i32),
    path: String,
    // Kept open for the process: the function pointers above point into these.
    _libs: Vec<Library>,
}

impl std::fmt::Debug for NvrtcLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvrtcLibrary").field("path", &self.path).field("version", &self.version).finish()
    }
}

impl NvrtcLibrary {
    /// The file or linker name it was opened by.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// NVRTC's (major, minor) version.
    pub fn version(&self) -> (i32, i32) {
        self.version
    }

    /// `Ok` for `NVRTC_SUCCESS`, else the error NVRTC names for `status` after `what`.
    pub(crate) fn check(&self, what: &str, status: Status) -> std::result::Result<(), String> {
        if status == 0 {
            return Ok(());
        }
        // SAFETY: nvrtcGetErrorString takes any code and returns a static string or null.
        let text = unsafe { (self.error_string)(status) };
        let name = if text.is_null() {
            format!("status {status}")
        } else {
            // SAFETY: a non-null result is a NUL-terminated static string.
            unsafe { std::ffi::CStr::from_ptr(text) }.to_string_lossy().into_owned()
        };
        Err(format!("{what}: {name}"))
    }

    /// Open `name` (a path, or a name the dynamic linker resolves) and read its functions.
    fn open(name: &str) -> std::result::Result<Self, String> {
        // SAFETY: loading libnvrtc runs only its initialisers, which have no preconditions.
        let lib = unsafe { Library::new(name) }.map_err(|e| e.to_string())?;
        let (version, fns) = {
            // SAFETY: each symbol is NVRTC's C function of the type named (NVRTC 11-13 API).
            let sym = |s: &[u8]| unsafe { lib.get::<*const c_void>(s).map(|p| *p) };
            let missing = |s: &str| format!("{name} has no {s}");
            macro_rules! load {
                ($s:literal, $t:ty) => {{
                    let p = sym(concat!($s, "\0").as_bytes()).map_err(|_| missing($s))?;
                    // SAFETY: `p` is the address of the function `$s`, whose C type is `$t`.
                    unsafe { std::mem::transmute::<*const c_void, $t>(p) }
                }};
            }
            let version_fn = load!("nvrtcVersion", VersionFn);
            let (mut major, mut minor) = (0, 0);
            // SAFETY: both out-pointers are valid for the call.
            if unsafe { version_fn(&mut major, &mut minor) } != 0 {
                return Err(format!("{name}: nvrtcVersion failed"));
            }
            let fns = (
                load!("nvrtcCreateProgram", CreateFn),
                load!("nvrtcDestroyProgram", DestroyFn),
                load!("nvrtcCompileProgram", CompileFn),
                load!("nvrtcGetProgramLogSize", SizeFn),
                load!("nvrtcGetProgramLog", BytesFn),
                load!("nvrtcGetPTXSize", SizeFn),
                load!("nvrtcGetPTX", BytesFn),
                load!("nvrtcGetCUBINSize", SizeFn),
                load!("nvrtcGetCUBIN", BytesFn),
                load!("nvrtcGetErrorString", ErrorStringFn),
            );
            ((major, minor), fns)
        };
        let (create, destroy, compile, log_size, log, ptx_size, ptx, cubin_size, cubin, error_string) = fns;
        let mut libs = vec![lib];
        // NVRTC 13 opens its builtins library by name at compile time; one beside the file
        // opened here is loaded first, so that name resolves without LD_LIBRARY_PATH.
        if let Some(dir) = Path::new(name).parent().filter(|d| !d.as_os_str().is_empty()) {
            let builtins = dir.join(format!("libnvrtc-builtins.so.{}.{}", version.0, version.1));
            if builtins.is_file() {
                // SAFETY: as for libnvrtc: initialisers only.
                libs.push(unsafe { Library::new(&builtins) }.map_err(|e| e.to_string())?);
            }
        }
        Ok(NvrtcLibrary {
            create,
            destroy,
            compile,
            log_size,
            log,
            ptx_size,
            ptx,
            cubin_size,
            cubin,
            error_string,
            version,
            path: name.to_string(),
            _libs: libs,
        })
    }
}

/// Directories callers added with [`add_nvrtc_search_dirs`].
fn added_dirs() -> &'static Mutex<Vec<PathBuf>> {
    static DIRS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
    &DIRS
}

/// Search `dirs` too (after the linker's path, before the CUDA toolkit's directories),
/// from the next lookup on. A library already opened stays the one used.
pub fn add_nvrtc_search_dirs(dirs: impl IntoIterator<Item = PathBuf>) {
    let mut added = added_dirs().lock().unwrap_or_else(|e| e.into_inner());
    for d in dirs {
        if !added.contains(&d) {
            added.push(d);
        }
    }
}

/// The CUDA toolkit's library directories: `CUDA_HOME`, `CUDA_PATH`, `/usr/local/cuda` and
/// the versioned `/usr/local/cuda-*` (newest first).
fn toolkit_dirs() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> =
        ["CUDA_HOME", "CUDA_PATH"].iter().filter_map(std::env::var_os).map(PathBuf::from).collect();
    roots.push(PathBuf::from("/usr/local/cuda"));
    let mut versioned: Vec<PathBuf> = std::fs::read_dir("/usr/local")
        .map(|d| d.flatten().map(|e| e.path()).filter(|p| is_versioned_cuda(p)).collect())
        .unwrap_or_default();
    versioned.sort_by_key(|p| std::cmp::Reverse(version_key(p)));
    roots.extend(versioned);
    roots.iter().flat_map(|r| [r.join("lib64"), r.join("lib"), r.join("targets/x86_64-linux/lib")]).collect()
}

fn is_versioned_cuda(p: &Path) -> bool {
    p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("cuda-"))
}

/// The numbers of a name such as `cuda-12.9` or `libnvrtc.so.13`, for ordering.
fn version_key(p: &Path) -> Vec<u32> {
    let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
    name.split(|c: char| !c.is_ascii_digit()).filter_map(|s| s.parse().ok()).collect()
}

/// The libnvrtc files in `dir`: versioned ones newest first, then the plain name. Other
/// files of NVRTC's wheels (`libnvrtc.alt.so.*`, `libnvrtc-builtins*`) are not candidates.
pub fn nvrtc_files_in(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut files: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                n.strip_prefix("libnvrtc.so").is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
            })
        })
        .collect();
    files.sort_by_key(|p| std::cmp::Reverse(version_key(p)));
    files
}

/// Where the lookup goes, in order: the explicit file, else linker names and directories.
#[derive(Debug, Clone)]
pub struct NvrtcSearch {
    /// `ATTN_NVRTC_PATH`, when set: the only candidate.
    pub explicit: Option<PathBuf>,
    /// Names the dynamic linker resolves.
    pub linker_names: Vec<String>,
    /// Directories whose libnvrtc files are tried, in order.
    pub dirs: Vec<PathBuf>,
}

impl NvrtcSearch {
    /// This process's search: the environment, the added directories and the toolkit's.
    pub fn from_env() -> Self {
        let explicit = std::env::var_os(NVRTC_PATH_ENV).filter(|p| !p.is_empty()).map(PathBuf::from);
        let mut dirs = added_dirs().lock().unwrap_or_else(|e| e.into_inner()).clone();
        dirs.extend(toolkit_dirs());
        NvrtcSearch { explicit, linker_names: LINKER_NAMES.iter().map(|s| s.to_string()).collect(), dirs }
    }

    /// Every candidate, in the order they are tried.
    pub fn candidates(&self) -> Vec<String> {
        if let Some(p) = &self.explicit {
            return vec![p.to_string_lossy().into_owned()];
        }
        let files = self.dirs.iter().flat_map(|d| nvrtc_files_in(d));
        self.linker_names.iter().cloned().chain(files.map(|f| f.to_string_lossy().into_owned())).collect()
    }

    /// Open the first candidate that loads, or say what was tried.
    pub fn open(&self) -> Result<NvrtcLibrary> {
        let candidates = self.candidates();
        let mut failures = Vec::new();
        for c in &candidates {
            match NvrtcLibrary::open(c) {
                Ok(lib) => return Ok(lib),
                Err(e) => failures.push(e),
            }
        }
        let reason = match &self.explicit {
            Some(p) => format!("{NVRTC_PATH_ENV}={} did not load: {}", p.display(), failures.join("; ")),
            None => format!(
                "libnvrtc was not found: tried {} through the dynamic linker and {} file(s) in {} directories \
                 (install nvidia-cuda-nvrtc for CUDA 13 or nvidia-cuda-nvrtc-cu12, put its lib directory on \
                 LD_LIBRARY_PATH, or set {NVRTC_PATH_ENV} to the library file)",
                self.linker_names.join(", "),
                candidates.len() - self.linker_names.len(),
                self.dirs.len()
            ),
        };
        Err(AttnError::BackendUnavailable { backend: "cuda", reason })
    }
}

/// The process's libnvrtc, opened on first success and kept; a failed lookup is retried on
/// the next call (directories may have been added since).
pub fn nvrtc_library() -> Result<&'static NvrtcLibrary> {
    static OPENED: OnceLock<NvrtcLibrary> = OnceLock::new();
    static SEARCHING: Mutex<()> = Mutex::new(());
    if let Some(lib) = OPENED.get() {
        return Ok(lib);
    }
    let _one_search = SEARCHING.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(lib) = OPENED.get() {
        return Ok(lib);
    }
    let lib = NvrtcSearch::from_env().open()?;
    Ok(OPENED.get_or_init(|| lib))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_libnvrtc_files_are_candidates_newest_first() {
        let dir = std::env::temp_dir().join(format!("attn-nvrtc-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for f in [
            "libnvrtc.so",
            "libnvrtc.so.12",
            "libnvrtc.so.13",
            "libnvrtc.alt.so.13",
            "libnvrtc-builtins.so.13.0",
            "libnvrtcx.so",
        ] {
            std::fs::write(dir.join(f), b"").unwrap();
        }
        let names: Vec<String> =
            nvrtc_files_in(&dir).iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(names, ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]);
    }

    #[test]
    fn an_explicit_path_is_the_only_candidate_and_its_failure_names_it() {
        let search = NvrtcSearch {
            explicit: Some(PathBuf::from("/nonexistent/libnvrtc.so.13")),
            linker_names: vec!["libnvrtc.so".into()],
            dirs: vec![PathBuf::from("/usr/local/cuda/lib64")],
        };
        assert_eq!(search.candidates(), ["/nonexistent/libnvrtc.so.13"]);
        let err = search.open().unwrap_err().to_string();
        assert!(err.contains("ATTN_NVRTC_PATH=/nonexistent/libnvrtc.so.13 did not load"), "{err}");
    }

    #[test]
    fn a_failed_search_says_what_it_tried() {
        let search = NvrtcSearch {
            explicit: None,
            linker_names: vec!["libnvrtc-attn-absent.so".into()],
            dirs: vec![PathBuf::from("/nonexistent-a"), PathBuf::from("/nonexistent-b")],
        };
        let err = search.open().unwrap_err().to_string();
        assert!(err.contains("tried libnvrtc-attn-absent.so") && err.contains("in 2 directories"), "{err}");
        assert!(err.contains(NVRTC_PATH_ENV), "{err}");
    }
}
