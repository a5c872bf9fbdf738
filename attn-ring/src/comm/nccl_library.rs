//! libnccl opened as `attn_kernels::cuda::LibrarySearch` says (`ATTN_NCCL_PATH`,
//! `libnccl.so.2` as NCCL's packages and PyTorch's wheels ship it, `libnccl.so`, added and
//! CUDA toolkit directories), with the functions `nccl_handle` calls read once. cudarc's
//! lookup does not try `libnccl.so.2`. Status codes stay integers, so a code newer than
//! these bindings is a value to report, never undefined behaviour.
#![allow(unsafe_code)]

use std::ffi::{CStr, c_char, c_int, c_void};

use attn_core::{AttnError, Result};
use attn_kernels::cuda::{LibrarySearch, OpenedOnce};
use cudarc::nccl::sys;
use libloading::Library;

/// The environment variable naming libnccl's file. When it is set, nothing else is tried.
pub const NCCL_PATH_ENV: &str = "ATTN_NCCL_PATH";

/// NCCL's result code (`ncclResult_t`).
pub(crate) type Status = c_int;
/// `ncclSuccess`.
pub(crate) const SUCCESS: Status = 0;
/// `ncclInProgress`: a non-blocking call has not finished.
pub(crate) const IN_PROGRESS: Status = 7;
/// Whether `code` is an error: anything but `ncclSuccess` and `ncclInProgress` (a
/// non-blocking call still running, finished by polling `ncclCommGetAsyncError`).
pub(crate) fn is_error(code: Status) -> bool {
    code != SUCCESS && code != IN_PROGRESS
}

/// `ncclUint8`, the type of every buffer the ring sends.
pub(crate) const UINT8: c_int = 1;

type Comm = sys::ncclComm_t;
type Stream = sys::cudaStream_t;

/// An opened libnccl: the functions the ring calls and its version.
pub struct NcclLibrary {
    pub(crate) get_unique_id: unsafe extern "C" fn(*mut sys::ncclUniqueId) -> Status,
    pub(crate) comm_init_rank_config:
        unsafe extern "C" fn(*mut Comm, c_int, sys::ncclUniqueId, c_int, *mut sys::ncclConfig_t) -> Status,
    pub(crate) comm_get_async_error: unsafe extern "C" fn(Comm, *mut Status) -> Status,
    pub(crate) get_last_error: unsafe extern "C" fn(Comm) -> *const c_char,
    get_error_string: unsafe extern "C" fn(Status) -> *const c_char,
    pub(crate) group_start: unsafe extern "C" fn() -> Status,
    pub(crate) group_end: unsafe extern "C" fn() -> Status,
    pub(crate) send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, Comm, Stream) -> Status,
    pub(crate) recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, Comm, Stream) -> Status,
    pub(crate) comm_abort: unsafe extern "C" fn(Comm) -> Status,
    version: c_int,
    path: String,
    // Kept open for the process: the function pointers above point into it.
    _lib: Library,
}

impl std::fmt::Debug for NcclLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclLibrary").field("path", &self.path).field("version", &self.version).finish()
    }
}

/// The name of NCCL result `code`, as `ncclResult_t` spells it.
pub(crate) fn status_name(code: Status) -> String {
    let names = [
        "ncclSuccess",
        "ncclUnhandledCudaError",
        "ncclSystemError",
        "ncclInternalError",
        "ncclInvalidArgument",
        "ncclInvalidUsage",
        "ncclRemoteError",
        "ncclInProgress",
    ];
    usize::try_from(code)
        .ok()
        .and_then(|i| names.get(i))
        .map_or_else(|| format!("NCCL result {code}"), |n| n.to_string())
}

impl NcclLibrary {
    /// The file or linker name it was opened by.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// `NCCL_VERSION_CODE` of the library (e.g. 23007 for 2.30.7).
    pub fn version(&self) -> i32 {
        self.version
    }

    /// `code`'s name and NCCL's text for it.
    pub(crate) fn describe(&self, code: Status) -> String {
        // SAFETY: ncclGetErrorString takes any code and returns a static string or null.
        let text = unsafe { (self.get_error_string)(code) };
        if text.is_null() {
            return status_name(code);
        }
        // SAFETY: a non-null result is a NUL-terminated static string.
        let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
        format!("{} ({text})", status_name(code))
    }

    /// Open `name` (a path, or a name the dynamic linker resolves) and read its functions.
    fn open(name: &str) -> std::result::Result<Self, String> {
        // SAFETY: loading libnccl runs only its initialisers, which have no preconditions.
        let lib = unsafe { Library::new(name) }.map_err(|e| e.to_string())?;
        macro_rules! load {
            ($s:literal) => {{
                // SAFETY: the symbol is NCCL's C function `$s`, whose C type (NCCL 2.17 and
                // later) is the field's type it is assigned to.
                let f = unsafe { lib.get(concat!($s, "\0").as_bytes()) };
                *f.map_err(|_| format!("{name} has no {}", $s))?
            }};
        }
        let get_version: unsafe extern "C" fn(*mut c_int) -> Status = load!("ncclGetVersion");
        let mut version = 0;
        // SAFETY: `version` is a valid out-pointer.
        if unsafe { get_version(&mut version) } != SUCCESS {
            return Err(format!("{name}: ncclGetVersion failed"));
        }
        Ok(NcclLibrary {
            get_unique_id: load!("ncclGetUniqueId"),
            comm_init_rank_config: load!("ncclCommInitRankConfig"),
            comm_get_async_error: load!("ncclCommGetAsyncError"),
            get_last_error: load!("ncclGetLastError"),
            get_error_string: load!("ncclGetErrorString"),
            group_start: load!("ncclGroupStart"),
            group_end: load!("ncclGroupEnd"),
            send: load!("ncclSend"),
            recv: load!("ncclRecv"),
            comm_abort: load!("ncclCommAbort"),
            version,
            path: name.to_string(),
            _lib: lib,
        })
    }

    /// A fresh unique id (`ncclGetUniqueId`; it needs no GPU).
    pub fn unique_id(&self) -> std::result::Result<[u8; 128], String> {
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        // SAFETY: `id` is a valid out-pointer to a 128-byte id.
        let status = unsafe { (self.get_unique_id)(&mut id) };
        if status != SUCCESS {
            return Err(format!("ncclGetUniqueId: {}", self.describe(status)));
        }
        Ok(id.internal.map(|c| c as u8))
    }
}

/// This process's lookup of libnccl.
pub fn nccl_search() -> LibrarySearch {
    LibrarySearch::from_env(
        "libnccl",
        NCCL_PATH_ENV,
        &["libnccl.so.2", "libnccl.so"],
        "NCCL (libnccl2, or the nvidia-nccl-cu12/cu13 wheel)",
    )
}

/// The first libnccl of `search` that opens, or `BackendUnavailable` saying what was tried.
pub fn open_nccl(search: &LibrarySearch) -> Result<NcclLibrary> {
    search.open_first(NcclLibrary::open).map_err(|reason| AttnError::BackendUnavailable { backend: "NCCL", reason })
}

/// The process's libnccl, opened on first success and kept; a failed lookup is retried.
pub fn nccl_library() -> Result<&'static NcclLibrary> {
    static NCCL: OpenedOnce<NcclLibrary> = OpenedOnce::new();
    NCCL.get_or_open(|| open_nccl(&nccl_search()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn result_codes_are_named_and_unknown_ones_are_values() {
        assert_eq!(status_name(SUCCESS), "ncclSuccess");
        assert_eq!(status_name(IN_PROGRESS), "ncclInProgress");
        assert_eq!(status_name(6), "ncclRemoteError");
        assert_eq!(status_name(42), "NCCL result 42");
        assert_eq!(status_name(-1), "NCCL result -1");
    }
}
