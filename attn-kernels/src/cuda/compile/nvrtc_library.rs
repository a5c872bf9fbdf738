//! libnvrtc for CUDA 12 and 13 alike, opened as [`LibrarySearch`] says (`ATTN_NVRTC_PATH`,
//! `libnvrtc.so.13`/`.so.12`/`.so`, added and CUDA toolkit directories), with the
//! functions this crate calls read once.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_void};
use std::path::Path;

use attn_core::{AttnError, Result};
use libloading::Library;

use super::library_search::{LibrarySearch, OpenedOnce};

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
type NumArchsFn = unsafe extern "C" fn(*mut c_int) -> Status;
type ArchsFn = unsafe extern "C" fn(*mut c_int) -> Status;

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
    /// `nvrtcGetNumSupportedArchs` and `nvrtcGetSupportedArchs` (NVRTC 11.2 and newer).
    supported_archs: Option<(NumArchsFn, ArchsFn)>,
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

    /// The architectures this NVRTC compiles for, as `10 * major + minor` (`90` for
    /// sm_90), ascending; `None` where the library cannot say.
    pub fn supported_archs(&self) -> Option<Vec<i32>> {
        let (count_fn, archs_fn) = self.supported_archs?;
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer.
        if unsafe { count_fn(&mut n) } != 0 || n <= 0 {
            return None;
        }
        let mut archs = vec![0 as c_int; n as usize];
        // SAFETY: `archs` holds the `n` entries NVRTC just reported.
        if unsafe { archs_fn(archs.as_mut_ptr()) } != 0 {
            return None;
        }
        archs.sort_unstable();
        Some(archs)
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
        macro_rules! load {
            ($s:literal) => {{
                // SAFETY: the symbol is NVRTC's C function `$s`, whose C type (NVRTC 11-13)
                // is the type of the binding or field it is assigned to.
                let f = unsafe { lib.get(concat!($s, "\0").as_bytes()) };
                *f.map_err(|_| format!("{name} has no {}", $s))?
            }};
        }
        let version_fn: VersionFn = load!("nvrtcVersion");
        let (mut major, mut minor) = (0, 0);
        // SAFETY: both out-pointers are valid for the call.
        if unsafe { version_fn(&mut major, &mut minor) } != 0 {
            return Err(format!("{name}: nvrtcVersion failed"));
        }
        let mut nvrtc = NvrtcLibrary {
            create: load!("nvrtcCreateProgram"),
            destroy: load!("nvrtcDestroyProgram"),
            compile: load!("nvrtcCompileProgram"),
            log_size: load!("nvrtcGetProgramLogSize"),
            log: load!("nvrtcGetProgramLog"),
            ptx_size: load!("nvrtcGetPTXSize"),
            ptx: load!("nvrtcGetPTX"),
            cubin_size: load!("nvrtcGetCUBINSize"),
            cubin: load!("nvrtcGetCUBIN"),
            error_string: load!("nvrtcGetErrorString"),
            supported_archs: optional(&lib),
            version: (major, minor),
            path: name.to_string(),
            _libs: vec![lib],
        };
        // NVRTC 13 opens its builtins library by name at compile time; one beside the file
        // opened here is loaded first, so that name resolves without LD_LIBRARY_PATH.
        if let Some(dir) = Path::new(name).parent().filter(|d| !d.as_os_str().is_empty()) {
            let builtins = dir.join(format!("libnvrtc-builtins.so.{major}.{minor}"));
            if builtins.is_file() {
                // SAFETY: as for libnvrtc: initialisers only.
                nvrtc._libs.push(unsafe { Library::new(&builtins) }.map_err(|e| e.to_string())?);
            }
        }
        Ok(nvrtc)
    }
}

/// The supported-architecture queries, where `lib` has them.
fn optional(lib: &Library) -> Option<(NumArchsFn, ArchsFn)> {
    // SAFETY: these are NVRTC's C functions of the same names (NVRTC 11.2 and newer),
    // whose C types are `NumArchsFn` and `ArchsFn`.
    unsafe {
        let count = lib.get::<NumArchsFn>(b"nvrtcGetNumSupportedArchs\0").ok()?;
        let archs = lib.get::<ArchsFn>(b"nvrtcGetSupportedArchs\0").ok()?;
        Some((*count, *archs))
    }
}

/// This process's lookup of libnvrtc.
pub fn nvrtc_search() -> LibrarySearch {
    LibrarySearch::from_env(
        "libnvrtc",
        NVRTC_PATH_ENV,
        &LINKER_NAMES,
        "nvidia-cuda-nvrtc (CUDA 13) or nvidia-cuda-nvrtc-cu12",
    )
}

/// The first libnvrtc of `search` that opens, or `BackendUnavailable` saying what was tried.
pub fn open_nvrtc(search: &LibrarySearch) -> Result<NvrtcLibrary> {
    search.open_first(NvrtcLibrary::open).map_err(|reason| AttnError::BackendUnavailable { backend: "cuda", reason })
}

/// The process's libnvrtc, opened on first success and kept; a failed lookup is retried on
/// the next call (directories may have been added since).
pub fn nvrtc_library() -> Result<&'static NvrtcLibrary> {
    static NVRTC: OpenedOnce<NvrtcLibrary> = OpenedOnce::new();
    NVRTC.get_or_open(|| open_nvrtc(&nvrtc_search()))
}
