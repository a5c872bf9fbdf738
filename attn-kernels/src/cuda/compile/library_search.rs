//! Where a CUDA library (libnvrtc, libnccl) is looked for, in order: the file an
//! environment variable names (then nothing else); versioned and plain names through the
//! dynamic linker, which also reuses a copy the process has loaded; the directories callers
//! added (a Python package adds its NVIDIA wheels'); the CUDA toolkit's directories.
//! cudarc's own lookup knows only the names of the CUDA version it was built for.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// A library opened once for the process: the first successful open is kept, and a
/// failed one is retried by the next call (directories may have been added since).
#[derive(Debug)]
pub struct OpenedOnce<T> {
    opened: OnceLock<T>,
    searching: Mutex<()>,
}

impl<T> OpenedOnce<T> {
    /// Nothing opened yet.
    pub const fn new() -> Self {
        OpenedOnce { opened: OnceLock::new(), searching: Mutex::new(()) }
    }

    /// The library, opened by `open` unless an earlier call did; one search at a time.
    pub fn get_or_open<E>(&self, open: impl FnOnce() -> Result<T, E>) -> Result<&T, E> {
        if let Some(lib) = self.opened.get() {
            return Ok(lib);
        }
        let _one_search = self.searching.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(lib) = self.opened.get() {
            return Ok(lib);
        }
        let lib = open()?;
        Ok(self.opened.get_or_init(|| lib))
    }
}

impl<T> Default for OpenedOnce<T> {
    fn default() -> Self {
        Self::new()
    }
}

/// Directories callers added with [`add_library_search_dirs`].
fn added_dirs() -> &'static Mutex<Vec<PathBuf>> {
    static DIRS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
    &DIRS
}

/// Search `dirs` too (after the dynamic linker, before the CUDA toolkit's directories),
/// for every library from its next lookup on. A library already opened stays in use.
pub fn add_library_search_dirs(dirs: impl IntoIterator<Item = PathBuf>) {
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
        .map(|d| d.flatten().map(|e| e.path()).filter(|p| file_name(p).starts_with("cuda-")).collect())
        .unwrap_or_default();
    versioned.sort_by_key(|p| std::cmp::Reverse(version_key(p)));
    roots.extend(versioned);
    // The toolkit's per-target directory: `x86_64-linux`, or `sbsa-linux` on Arm servers.
    let target = if cfg!(target_arch = "aarch64") { "targets/sbsa-linux/lib" } else { "targets/x86_64-linux/lib" };
    roots.iter().flat_map(|r| [r.join("lib64"), r.join("lib"), r.join(target)]).collect()
}

fn file_name(p: &Path) -> &str {
    p.file_name().and_then(|n| n.to_str()).unwrap_or("")
}

/// The numbers of a name such as `cuda-12.9` or `libnvrtc.so.13`, for ordering.
fn version_key(p: &Path) -> Vec<u32> {
    file_name(p).split(|c: char| !c.is_ascii_digit()).filter_map(|s| s.parse().ok()).collect()
}

/// The files of library `stem` (e.g. `libnvrtc`) in `dir`: `stem.so.N...` newest first,
/// then `stem.so`. Other files of the wheels (`libnvrtc.alt.so.13`, `libnvrtc-builtins*`)
/// are not candidates.
pub fn library_files_in(dir: &Path, stem: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let plain = format!("{stem}.so");
    let mut files: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            file_name(p).strip_prefix(plain.as_str()).is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
        })
        .collect();
    files.sort_by_key(|p| std::cmp::Reverse(version_key(p)));
    files
}

/// One library's lookup (see the module docs).
#[derive(Debug, Clone)]
pub struct LibrarySearch {
    /// The library's file stem, e.g. `libnvrtc`.
    pub stem: &'static str,
    /// The environment variable naming its file.
    pub env: &'static str,
    /// That variable's value, when set: the only candidate.
    pub explicit: Option<PathBuf>,
    /// Names the dynamic linker resolves, tried in order.
    pub linker_names: Vec<String>,
    /// Directories whose files of the library are tried, in order.
    pub dirs: Vec<PathBuf>,
    /// What to install, for the message of a failed search.
    pub install: &'static str,
}

impl LibrarySearch {
    /// This process's lookup of `stem`: `env` from the environment, then `linker_names`,
    /// the added directories and the CUDA toolkit's.
    pub fn from_env(stem: &'static str, env: &'static str, linker_names: &[&str], install: &'static str) -> Self {
        let explicit = std::env::var_os(env).filter(|p| !p.is_empty()).map(PathBuf::from);
        let mut dirs = added_dirs().lock().unwrap_or_else(|e| e.into_inner()).clone();
        dirs.extend(toolkit_dirs());
        LibrarySearch {
            stem,
            env,
            explicit,
            linker_names: linker_names.iter().map(|s| s.to_string()).collect(),
            dirs,
            install,
        }
    }

    /// Every candidate, in the order they are tried.
    pub fn candidates(&self) -> Vec<String> {
        if let Some(p) = &self.explicit {
            return vec![p.to_string_lossy().into_owned()];
        }
        let files = self.dirs.iter().flat_map(|d| library_files_in(d, self.stem));
        self.linker_names.iter().cloned().chain(files.map(|f| f.to_string_lossy().into_owned())).collect()
    }

    /// The first candidate `open` accepts, or why none did: the explicit file's error, or
    /// what was searched and why each file found failed.
    pub fn open_first<T>(&self, mut open: impl FnMut(&str) -> Result<T, String>) -> Result<T, String> {
        let candidates = self.candidates();
        let mut failures = Vec::new();
        for (i, c) in candidates.iter().enumerate() {
            match open(c) {
                Ok(lib) => return Ok(lib),
                // A linker name that does not resolve is the usual case, not news.
                Err(e) if self.explicit.is_some() || i >= self.linker_names.len() => failures.push(e),
                Err(_) => {}
            }
        }
        if let Some(p) = &self.explicit {
            return Err(format!("{}={} did not load: {}", self.env, p.display(), failures.join("; ")));
        }
        let found = candidates.len() - self.linker_names.len();
        let mut reason = format!(
            "{} was not found: tried {} through the dynamic linker and {found} file(s) in {} directories",
            self.stem,
            self.linker_names.join(", "),
            self.dirs.len()
        );
        if !failures.is_empty() {
            reason += &format!(" ({})", failures.join("; "));
        }
        reason += &format!(
            "; install {}, put its lib directory on LD_LIBRARY_PATH, or set {} to the library file",
            self.install, self.env
        );
        Err(reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn search(explicit: Option<&str>, linker_names: &[&str], dirs: &[&str]) -> LibrarySearch {
        LibrarySearch {
            stem: "libnvrtc",
            env: "ATTN_NVRTC_PATH",
            explicit: explicit.map(PathBuf::from),
            linker_names: linker_names.iter().map(|s| s.to_string()).collect(),
            dirs: dirs.iter().map(PathBuf::from).collect(),
            install: "nvidia-cuda-nvrtc",
        }
    }

    #[test]
    fn only_the_librarys_files_are_candidates_newest_first() {
        let dir = std::env::temp_dir().join(format!("attn-library-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let files = ["libnvrtc.so", "libnvrtc.so.12", "libnvrtc.so.13", "libnvrtc.alt.so.13"];
        for f in files.iter().chain(&["libnvrtc-builtins.so.13.0", "libnvrtcx.so"]) {
            std::fs::write(dir.join(f), b"").unwrap();
        }
        let names: Vec<String> = library_files_in(&dir, "libnvrtc").iter().map(|p| file_name(p).to_string()).collect();
        let s = search(None, &["libnvrtc.so.13"], &[dir.to_str().unwrap()]);
        let candidates = s.candidates();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(names, ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]);
        assert_eq!(candidates.len(), 4);
        assert_eq!(candidates[0], "libnvrtc.so.13");
        assert!(candidates[1].ends_with("/libnvrtc.so.13"), "{candidates:?}");
    }

    #[test]
    fn the_toolkits_directories_are_searched() {
        let dirs = toolkit_dirs();
        for d in ["/usr/local/cuda/lib64", "/usr/local/cuda/lib"] {
            assert!(dirs.contains(&PathBuf::from(d)), "{d} missing from {dirs:?}");
        }
        let target = if cfg!(target_arch = "aarch64") { "sbsa-linux" } else { "x86_64-linux" };
        assert!(dirs.contains(&PathBuf::from(format!("/usr/local/cuda/targets/{target}/lib"))), "{dirs:?}");
    }

    #[test]
    fn an_explicit_path_is_the_only_candidate_and_its_failure_names_it() {
        let s = search(Some("/nonexistent/libnvrtc.so.13"), &["libnvrtc.so"], &["/usr/local/cuda/lib64"]);
        assert_eq!(s.candidates(), ["/nonexistent/libnvrtc.so.13"]);
        let err = s.open_first(|c| Err::<(), _>(format!("{c}: no such file"))).unwrap_err();
        assert_eq!(
            err,
            "ATTN_NVRTC_PATH=/nonexistent/libnvrtc.so.13 did not load: /nonexistent/libnvrtc.so.13: no such file"
        );
    }

    #[test]
    fn the_first_candidate_that_opens_is_taken() {
        let s = search(None, &["a", "b", "c"], &[]);
        let mut tried = Vec::new();
        let got = s.open_first(|c| {
            tried.push(c.to_string());
            if c == "b" { Ok(c.to_string()) } else { Err(format!("{c} failed")) }
        });
        assert_eq!(got.unwrap(), "b");
        assert_eq!(tried, ["a", "b"]);
    }

    #[test]
    fn a_failed_search_says_what_it_tried() {
        let s = search(None, &["libnvrtc-attn-absent.so"], &["/nonexistent-a", "/nonexistent-b"]);
        let err = s.open_first(|c| Err::<(), _>(format!("{c} failed"))).unwrap_err();
        assert!(err.starts_with("libnvrtc was not found: tried libnvrtc-attn-absent.so"), "{err}");
        assert!(err.contains("0 file(s) in 2 directories") && err.contains("ATTN_NVRTC_PATH"), "{err}");
        assert!(!err.contains("libnvrtc-attn-absent.so failed"), "{err}");
    }
}
