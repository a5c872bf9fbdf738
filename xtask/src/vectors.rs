//! The in-repo conformance vectors against their upstream (`cargo xtask tidy
//! --upstream-golden DIR`): every upstream file in a directory `conformance/` holds must
//! be there with the same bytes, so vectors arrive by a copy and nothing else. Upstream
//! directories `conformance/` does not hold yet are listed, not failed: a new upstream
//! directory arrives before its copy and its runner.

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

/// What comparing `conformance/` with its upstream found.
#[derive(Debug, Default, PartialEq)]
pub struct Comparison {
    /// Upstream files missing from `local` or differing from it, one message each.
    pub problems: Vec<String>,
    /// Upstream top-level directories `local` does not hold (not compared).
    pub not_copied: Vec<String>,
}

/// `local` against `upstream`: every upstream file in a top-level directory `local` has
/// (and every upstream file at the top level) must be in `local` with the same bytes.
/// Files only in `local` are allowed (the project may hold more vectors).
pub fn compare(upstream: &Path, local: &Path) -> Result<Comparison, String> {
    let mut found = Comparison::default();
    for rel in files_under(upstream)? {
        let mut parts = rel.components();
        let top = parts.next().map(|c| c.as_os_str().to_string_lossy().into_owned()).unwrap_or_default();
        if parts.next().is_some() && !local.join(&top).is_dir() {
            if !found.not_copied.contains(&top) {
                found.not_copied.push(top);
            }
            continue;
        }
        let want = std::fs::read(upstream.join(&rel)).map_err(|e| format!("{}: {e}", rel.display()))?;
        match std::fs::read(local.join(&rel)) {
            Ok(got) if got == want => {}
            Ok(_) => found.problems.push(format!(
                "{} differs from {}",
                local.join(&rel).display(),
                upstream.join(&rel).display()
            )),
            Err(_) => found.problems.push(format!(
                "{} is missing (copy it from {})",
                local.join(&rel).display(),
                upstream.display()
            )),
        }
    }
    Ok(found)
}

/// The check `cargo xtask tidy --upstream-golden DIR` runs: `conformance/` against `upstream`.
pub fn check(root: &Path, upstream: &Path) -> Result<Comparison, String> {
    if !upstream.is_dir() {
        return Err(format!("--upstream-golden: {} is not a directory", upstream.display()));
    }
    let local = root.join("conformance");
    if !local.is_dir() {
        return Err(format!("{} is not a directory", local.display()));
    }
    compare(upstream, &local)
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
        assert_eq!(compare(&d.join("up"), &d.join("local")).unwrap(), Comparison::default());
    }

    #[test]
    fn a_missing_or_changed_file_in_a_copied_directory_fails() {
        let tmp = scratch();
        let d = tmp.path();
        std::fs::write(d.join("up/dilated/new.safetensors"), b"n").unwrap();
        let p = compare(&d.join("up"), &d.join("local")).unwrap().problems;
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0].contains("dilated/new.safetensors") && p[0].contains("missing"), "{p:?}");
        std::fs::write(d.join("local/dilated/a.safetensors"), b"aab").unwrap();
        let p = compare(&d.join("up"), &d.join("local")).unwrap().problems;
        assert!(p.iter().any(|m| m.contains("a.safetensors") && m.contains("differs")), "{p:?}");
    }

    /// An upstream directory not yet copied is listed, not failed; once copied, its files
    /// are compared.
    #[test]
    fn an_upstream_directory_not_yet_copied_is_listed_not_failed() {
        let tmp = scratch();
        let d = tmp.path();
        for dir in ["wide", "blocks"] {
            std::fs::create_dir_all(d.join("up").join(dir)).unwrap();
            std::fs::write(d.join("up").join(dir).join("x.safetensors"), b"w").unwrap();
        }
        let c = compare(&d.join("up"), &d.join("local")).unwrap();
        assert_eq!(c.problems, Vec::<String>::new());
        assert_eq!(c.not_copied, ["blocks", "wide"]);
        std::fs::create_dir_all(d.join("local/wide")).unwrap();
        let c = compare(&d.join("up"), &d.join("local")).unwrap();
        assert!(c.problems.len() == 1 && c.problems[0].contains("wide/x.safetensors"), "{c:?}");
        assert_eq!(c.not_copied, ["blocks"]);
    }

    #[test]
    fn an_upstream_that_is_not_a_directory_is_an_error() {
        let tmp = scratch();
        let e = check(tmp.path(), &tmp.path().join("nowhere")).unwrap_err();
        assert!(e.contains("--upstream-golden") && e.contains("nowhere"), "{e}");
        // `check` compares `ROOT/conformance`: an error while it is absent.
        assert!(check(tmp.path(), &tmp.path().join("up")).unwrap_err().contains("conformance"));
        std::fs::create_dir_all(tmp.path().join("conformance/dilated")).unwrap();
        assert_eq!(check(tmp.path(), &tmp.path().join("up")).unwrap().problems.len(), 1);
    }
}
