//! The in-repo conformance vectors against their upstream (`cargo xtask tidy
//! --upstream-golden DIR`): every file in the upstream golden folder must be in
//! `conformance/` with the same bytes, so new vectors arrive by a copy and nothing else.

use std::path::{Path, PathBuf};

/// Every file under `dir` (recursively, sorted), as paths relative to `dir`.
fn files_under(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let mut out = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let here = dir.join(&rel);
        let entries = std::fs::read_dir(&here).map_err(|e| format!("{}: {e}", here.display()))?;
        for entry in entries {
            let entry = entry.map_err(|e| format!("{}: {e}", here.display()))?;
            let kind = entry.file_type().map_err(|e| format!("{}: {e}", entry.path().display()))?;
            let name = rel.join(entry.file_name());
            if kind.is_dir() {
                stack.push(name);
            } else {
                out.push(name);
            }
        }
    }
    out.sort();
    Ok(out)
}

/// The files of `upstream` that are missing from `local` or differ from it, one message
/// each. Files only in `local` are allowed (the project may hold more vectors).
pub fn compare(upstream: &Path, local: &Path) -> Result<Vec<String>, String> {
    let mut problems = Vec::new();
    for rel in files_under(upstream)? {
        let want = std::fs::read(upstream.join(&rel)).map_err(|e| format!("{}: {e}", rel.display()))?;
        match std::fs::read(local.join(&rel)) {
            Ok(got) if got == want => {}
            Ok(_) => {
                problems.push(format!("{} differs from {}", local.join(&rel).display(), upstream.join(&rel).display()))
            }
            Err(_) => problems.push(format!(
                "{} is missing (copy it from {})",
                local.join(&rel).display(),
                upstream.display()
            )),
        }
    }
    Ok(problems)
}

/// The check `cargo xtask tidy --upstream-golden DIR` runs: `conformance/` against `upstream`.
pub fn check(root: &Path, upstream: &Path) -> Result<Vec<String>, String> {
    if !upstream.is_dir() {
        return Err(format!("--upstream-golden: {} is not a directory", upstream.display()));
    }
    compare(upstream, &root.join("conformance"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An upstream and a local copy holding one identical file, removed when the guard drops.
    fn scratch() -> tempfile::TempDir {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        std::fs::create_dir_all(d.join("up/dilated")).unwrap();
        std::fs::create_dir_all(d.join("local/dilated")).unwrap();
        std::fs::write(d.join("up/dilated/a.safetensors"), b"aaa").unwrap();
        std::fs::write(d.join("local/dilated/a.safetensors"), b"aaa").unwrap();
        tmp
    }

    #[test]
    fn an_identical_copy_passes_and_extra_local_files_are_allowed() {
        let tmp = scratch();
        let d = tmp.path();
        std::fs::write(d.join("local/dilated/extra.safetensors"), b"x").unwrap();
        assert_eq!(compare(&d.join("up"), &d.join("local")).unwrap(), Vec::<String>::new());
    }

    #[test]
    fn a_missing_or_changed_file_fails() {
        let tmp = scratch();
        let d = tmp.path();
        std::fs::create_dir_all(d.join("up/features")).unwrap();
        std::fs::write(d.join("up/features/new.safetensors"), b"n").unwrap();
        let p = compare(&d.join("up"), &d.join("local")).unwrap();
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0].contains("features/new.safetensors") && p[0].contains("missing"), "{p:?}");
        std::fs::write(d.join("local/dilated/a.safetensors"), b"aab").unwrap();
        let p = compare(&d.join("up"), &d.join("local")).unwrap();
        assert!(p.iter().any(|m| m.contains("a.safetensors") && m.contains("differs")), "{p:?}");
    }

    #[test]
    fn an_upstream_that_is_not_a_directory_is_an_error() {
        let tmp = scratch();
        let e = check(tmp.path(), &tmp.path().join("nowhere")).unwrap_err();
        assert!(e.contains("--upstream-golden") && e.contains("nowhere"), "{e}");
        assert_eq!(check(&tmp.path().join("local/.."), &tmp.path().join("up")).unwrap().len(), 1);
    }
}
