//! The test-binary rule checked by `cargo xtask tidy`: a crate's integration tests build
//! into one binary (`tests/main.rs`, one `mod` per test file), so each crate links and
//! instantiates its generic code once; a file that needs its own process (a global
//! allocator, a harness of its own, a name the GPU pack runs) is a `[[test]]` entry.
//! Under `autotests = false` an unlisted file would silently never build: this finds it.
//! With a `tests/main.rs`, proptest keeps a test file's seeds in
//! `proptest-regressions/<file>.txt` (beside `tests/`): seeds left beside the test file
//! would never replay.

use std::path::Path;

/// The test files of one crate: the stems of its `tests/*.rs` files and of its
/// `tests/*.proptest-regressions` seed files.
pub struct TestFiles {
    pub sources: Vec<String>,
    pub seeds: Vec<String>,
}

/// The problems of one crate's test layout: `manifest` is its Cargo.toml, `main` its
/// `tests/main.rs` (if any).
pub fn check_crate(manifest: &str, main: Option<&str>, files: &TestFiles) -> Vec<String> {
    let autotests_off = manifest.lines().any(|l| l.replace(' ', "") == "autotests=false");
    let mut problems = Vec::new();
    if main.is_some() {
        for stem in &files.seeds {
            problems.push(format!(
                "tests/{stem}.proptest-regressions never replays: proptest reads proptest-regressions/{stem}.txt"
            ));
        }
    }
    let files = &files.sources;
    if files.len() > 1 && !autotests_off {
        problems.push(format!(
            "{} test files build {} binaries: set `autotests = false` and declare them in tests/main.rs",
            files.len(),
            files.len()
        ));
        return problems;
    }
    if !autotests_off {
        return problems;
    }
    let is_target = |stem: &str| manifest.lines().any(|l| l.replace(' ', "") == format!("path=\"tests/{stem}.rs\""));
    let is_module = |stem: &str| {
        main.is_some_and(|m| {
            m.lines().any(|l| l.trim() == format!("mod {stem};") || l.trim() == format!("pub mod {stem};"))
        })
    };
    if main.is_some() && !is_target("main") {
        problems.push("tests/main.rs is no `[[test]]` target (`path = \"tests/main.rs\"`)".to_string());
    }
    for stem in files.iter().filter(|s| *s != "main") {
        if !is_target(stem) && !is_module(stem) {
            problems.push(format!("tests/{stem}.rs is neither a module of tests/main.rs nor a `[[test]]` target"));
        }
    }
    problems
}

/// Every workspace crate's problems, as `(crate directory, message)`.
pub fn check(root: &Path) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    let mut dirs: Vec<_> = std::fs::read_dir(root).map_err(|e| e.to_string())?.flatten().map(|e| e.path()).collect();
    dirs.sort();
    for dir in dirs {
        let (manifest, tests) = (dir.join("Cargo.toml"), dir.join("tests"));
        if !manifest.is_file() || !tests.is_dir() || dir == root {
            continue;
        }
        let text = std::fs::read_to_string(&manifest).map_err(|e| format!("{}: {e}", manifest.display()))?;
        let main = std::fs::read_to_string(tests.join("main.rs")).ok();
        let files =
            TestFiles { sources: stems_with(&tests, "rs")?, seeds: stems_with(&tests, "proptest-regressions")? };
        let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        out.extend(check_crate(&text, main.as_deref(), &files).into_iter().map(|m| (name.clone(), m)));
    }
    Ok(out)
}

/// The sorted stems of the files in `dir` with extension `ext`.
fn stems_with(dir: &Path, ext: &str) -> Result<Vec<String>, String> {
    let mut stems: Vec<String> = std::fs::read_dir(dir)
        .map_err(|e| e.to_string())?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == ext))
        .filter_map(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .collect();
    stems.sort();
    Ok(stems)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stems(s: &[&str]) -> TestFiles {
        TestFiles { sources: s.iter().map(|x| x.to_string()).collect(), seeds: Vec::new() }
    }

    const MANIFEST: &str = "[package]\nname = \"x\"\nautotests = false\n\n[[test]]\nname = \"integration\"\npath = \"tests/main.rs\"\n\n[[test]]\nname = \"alloc\"\npath = \"tests/alloc.rs\"\n";

    #[test]
    fn one_binary_with_listed_exceptions_passes() {
        let main = "//! Tests.\n\nmod common;\nmod golden;\n#[cfg(feature = \"ring\")]\nmod ring;\n";
        let problems = check_crate(MANIFEST, Some(main), &stems(&["alloc", "golden", "main", "ring"]));
        assert!(problems.is_empty(), "{problems:?}");
        // A single test file may stay an automatic target.
        assert!(check_crate("[package]\nname = \"y\"\n", None, &stems(&["runner"])).is_empty());
    }

    #[test]
    fn a_file_nobody_builds_is_found() {
        let main = "//! Tests.\n\nmod golden;\n";
        let problems = check_crate(MANIFEST, Some(main), &stems(&["alloc", "golden", "main", "forgotten"]));
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("tests/forgotten.rs"), "{problems:?}");
        let unlisted_main = MANIFEST.replace("path = \"tests/main.rs\"\n", "");
        assert!(check_crate(&unlisted_main, Some(main), &stems(&["golden", "main"]))[0].contains("main.rs"));
    }

    #[test]
    fn seeds_beside_a_module_are_found() {
        let main = "//! Tests.\n\nmod golden;\n";
        let files = TestFiles { seeds: vec!["golden".into()], ..stems(&["golden", "main"]) };
        let problems = check_crate(MANIFEST, Some(main), &files);
        assert!(problems.len() == 1 && problems[0].contains("proptest-regressions/golden.txt"), "{problems:?}");
        // Without tests/main.rs proptest reads seeds beside the file.
        let single = TestFiles { seeds: vec!["runner".into()], ..stems(&["runner"]) };
        assert!(check_crate("[package]\nname = \"y\"\n", None, &single).is_empty());
    }

    #[test]
    fn many_automatic_binaries_are_found() {
        let problems = check_crate("[package]\nname = \"y\"\n", None, &stems(&["a", "b"]));
        assert!(problems.len() == 1 && problems[0].contains("autotests"), "{problems:?}");
    }
}
