//! `cargo xtask tidy`: source hygiene checks over every `.rs` file of the repository:
//! opens with `//!` module docs, under 700 lines, no todo!/unimplemented!/dbg!, and a
//! `// SAFETY:` comment directly above every `unsafe` block or impl; project text
//! (`.rs`, `.md`, `.sh`) describes the project, not the work history; in attn-kernels
//! only the dispatch module names an instruction-set module and only `cpu_features`
//! checks CPU features; no manifest or source picks cudarc's linking mode (it stays
//! `fallback-dynamic-loading`, so the GPU features build beside candle's `cuda`); each crate's integration tests build into one binary
//! (`test_targets`); no crate has a file circle (`file_circles`); and the in-repo conformance vectors hold every upstream file
//! (`vectors`).

use std::path::{Path, PathBuf};

use crate::workspace::repo_root;
use crate::{file_circles, test_targets, vectors};

/// Longest allowed file, in lines.
pub const MAX_LINES: usize = 700;

/// Every file under `dir` whose name ends with one of `exts`, skipping `target/` and
/// hidden directories.
fn files_with(dir: &Path, exts: &[&str], out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut entries: Vec<_> = entries.flatten().map(|e| e.path()).collect();
    entries.sort();
    for p in entries {
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        if p.is_dir() {
            if name != "target" && name != "device-pack" && !name.starts_with('.') {
                files_with(&p, exts, out);
            }
        } else if exts.iter().any(|e| name.ends_with(e)) {
            out.push(p);
        }
    }
}

/// Whether the comment lines directly above line `i` (or line `i` itself) hold `SAFETY:`.
fn has_safety_comment(lines: &[&str], i: usize) -> bool {
    if lines[i].contains("SAFETY:") {
        return true;
    }
    let mut j = i;
    while j > 0 {
        j -= 1;
        let t = lines[j].trim_start();
        if t.starts_with("//") {
            if t.contains("SAFETY:") {
                return true;
            }
        } else if !t.starts_with("#[") {
            return false;
        }
    }
    false
}

/// The problems of one file's text, as `(line number, message)`.
pub fn check_text(text: &str) -> Vec<(usize, String)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut problems = Vec::new();
    if !lines.first().is_some_and(|l| l.starts_with("//!")) {
        problems.push((1, "does not open with a `//!` module doc line".to_string()));
    }
    if lines.len() > MAX_LINES {
        problems.push((lines.len(), format!("{} lines (limit {MAX_LINES})", lines.len())));
    }
    // Spelled in pieces so this file does not flag itself.
    let banned = [concat!("todo", "!("), concat!("unimplemented", "!("), concat!("dbg", "!(")];
    let unsafe_block = concat!("unsafe", " {");
    let unsafe_impl = concat!("unsafe", " impl");
    for (i, line) in lines.iter().enumerate() {
        let code = line.split("//").next().unwrap_or_default();
        for b in banned {
            if code.contains(b) {
                problems.push((i + 1, format!("contains `{b}`")));
            }
        }
        if (code.contains(unsafe_block) || code.contains(unsafe_impl)) && !has_safety_comment(&lines, i) {
            problems.push((i + 1, "`unsafe` without a `// SAFETY:` comment above it".to_string()));
        }
    }
    problems
}

/// The word for a unit of work history, spelled in pieces so this file passes its own check.
const HISTORY_WORD: &str = concat!("sess", "ion");

/// Lines of `text` that use the history word (singular or plural, any case, as a whole
/// word), as `(line number, message)`: project files describe the project as it is.
pub fn check_history_words(text: &str) -> Vec<(usize, String)> {
    let is_word = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
    let mut problems = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let lower = line.to_lowercase();
        let hit = lower.match_indices(HISTORY_WORD).any(|(at, w)| {
            let before = lower[..at].chars().next_back();
            let rest = &lower[at + w.len()..];
            let rest = rest.strip_prefix('s').unwrap_or(rest);
            !is_word(before) && !is_word(rest.chars().next())
        });
        if hit {
            problems.push((i + 1, format!("uses the word `{HISTORY_WORD}`: describe the project, not its history")));
        }
    }
    problems
}

/// The kernels' instruction-set modules: only the dispatch module (`ops`) and the
/// modules of this family itself may name them.
const ISA_MODULES: [&str; 4] = ["avx2", "avx512", "portable", "bf16_pairs"];

/// Whether `code` names module `m` as a path segment (`crate::cpu::isa::m`, `super::m`).
fn names_module(code: &str, m: &str) -> bool {
    let pat = format!("::{m}");
    code.match_indices(&pat)
        .any(|(at, _)| code[at + pat.len()..].chars().next().is_none_or(|c| !(c.is_alphanumeric() || c == '_')))
}

/// Problems of one attn-kernels source file (`rel`: its path under `src/`) against the
/// dispatch rule: outside `ops` and the ISA modules no path naming an ISA module, and
/// CPU feature checks only in `cpu_features`.
pub fn check_dispatch(rel: &str, text: &str) -> Vec<(usize, String)> {
    // A file is in the family where any part of its path (`cpu/isa/ops.rs`,
    // `cpu/isa/bf16_pairs/arch.rs`) is the dispatch module or an ISA module.
    let parts: Vec<&str> = rel.split('/').map(|p| p.trim_end_matches(".rs")).collect();
    let stem = parts.last().copied().unwrap_or_default();
    let in_family = parts.iter().any(|p| *p == "ops" || ISA_MODULES.contains(p));
    let mut problems = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let code = line.split("//").next().unwrap_or_default();
        if !in_family {
            for m in ISA_MODULES {
                let named = names_module(code, m)
                    || (code.contains("use ")
                        && code.contains("::{")
                        && code.split(['{', ',', '}', ' ']).any(|w| w == m));
                if named {
                    problems.push((i + 1, format!("names the ISA module `{m}`: go through the dispatch module `ops`")));
                }
            }
        }
        let detect = concat!("is_x86_feature", "_detected");
        if stem != "cpu_features" && code.contains(detect) {
            problems.push((i + 1, "checks a CPU feature outside `cpu_features`".to_string()));
        }
    }
    problems
}

/// cudarc's linking modes and the calls that exist in only one of them. The workspace asks
/// for `fallback-dynamic-loading`, which yields to a crate that picks a mode (candle's
/// `cuda` picks `dynamic-linking`): naming a mode itself would make the two fail to build
/// together.
const CUDARC_ONE_MODE: [&str; 5] =
    ["\"dynamic-loading\"", "\"dynamic-linking\"", "\"static-linking\"", "is_culib_present", "culib()"];

/// Problems of one file against the cudarc rule: no linking mode in a manifest, no call
/// that needs one in source.
pub fn check_cudarc_modes(text: &str) -> Vec<(usize, String)> {
    let mut problems = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let code = line.split(['#']).next().unwrap_or_default();
        let code = code.split("//").next().unwrap_or_default();
        for m in CUDARC_ONE_MODE {
            if code.contains(m) {
                problems.push((i + 1, format!("names `{m}`: cudarc's mode must stay `fallback-dynamic-loading`")));
            }
        }
    }
    problems
}

/// The crate directories directly under the root (each with a `Cargo.toml` and `src/`),
/// the workspace members and the crates outside it alike.
fn crate_dirs(root: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(root) else { return Vec::new() };
    let mut dirs: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("Cargo.toml").exists() && p.join("src").is_dir())
        .collect();
    dirs.sort();
    dirs
}

/// Check every file; fail listing the problems.
pub fn run(args: &[String]) -> Result<(), String> {
    let upstream = match args {
        [] => None,
        [flag, dir] if flag == "--upstream-golden" => Some(PathBuf::from(dir)),
        _ => return Err(format!("usage: tidy [--upstream-golden DIR] (got {args:?})")),
    };
    let root = repo_root();
    let mut files = Vec::new();
    files_with(&root, &[".rs", ".md", ".sh", "Cargo.toml"], &mut files);
    let mut count = 0;
    for f in &files {
        let text = std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?;
        let mut problems = check_history_words(&text);
        if f.ends_with("Cargo.toml") {
            problems.extend(check_cudarc_modes(&text));
        }
        if f.extension().is_some_and(|e| e == "rs") {
            problems.extend(check_text(&text));
            if !f.starts_with(root.join("xtask")) {
                problems.extend(check_cudarc_modes(&text));
            }
            if let Ok(rel) = f.strip_prefix(root.join("attn-kernels/src")) {
                problems.extend(check_dispatch(&rel.to_string_lossy(), &text));
            }
        }
        for (line, msg) in problems {
            println!("{}:{line}: {msg}", f.strip_prefix(&root).unwrap_or(f).display());
            count += 1;
        }
    }
    for krate in crate_dirs(&root) {
        for msg in file_circles::check_crate(&krate)? {
            println!("{}: {msg}", krate.strip_prefix(&root).unwrap_or(&krate).display());
            count += 1;
        }
    }
    for (krate, msg) in test_targets::check(&root)? {
        println!("{krate}: {msg}");
        count += 1;
    }
    match upstream {
        None => println!("tidy: conformance/ not compared with an upstream (--upstream-golden DIR)"),
        Some(dir) => {
            let found = vectors::check(&root, &dir)?;
            for m in &found.problems {
                println!("conformance: {m}");
            }
            if !found.not_copied.is_empty() {
                println!(
                    "tidy: upstream directories not in conformance/ yet (not compared): {}",
                    found.not_copied.join(", ")
                );
            }
            println!("tidy: conformance/ compared with {}, {} problem(s)", dir.display(), found.problems.len());
            count += found.problems.len();
        }
    }
    println!("tidy: {} files checked, {count} problem(s)", files.len());
    if count == 0 { Ok(()) } else { Err(format!("{count} problem(s)")) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clean_file_passes() {
        let src = "//! Docs.\n\nfn f() {\n    // SAFETY: the pointer is valid.\n    unsafe { g() }\n}\n";
        assert!(check_text(src).is_empty(), "{:?}", check_text(src));
    }

    #[test]
    fn only_the_dispatch_module_names_an_isa_module() {
        let call = format!("    {}::ds_row(p, dp, None, 0.0);\n", concat!("crate::av", "x2"));
        assert_eq!(check_dispatch("tile_backward.rs", &call).len(), 1);
        assert!(check_dispatch("ops.rs", &call).is_empty());
        assert!(check_dispatch("bf16_pairs/arch.rs", &call).is_empty());
        let nested = format!("    {}::ds_row(p, dp, None, 0.0);\n", concat!("crate::cpu::isa::av", "x2"));
        assert_eq!(check_dispatch("cpu/tiles/tile_backward.rs", &nested).len(), 1);
        assert!(check_dispatch("cpu/isa/ops.rs", &nested).is_empty());
        assert!(check_dispatch("cpu/isa/bf16_pairs/arch/dot.rs", &nested).is_empty());
        let sibling = format!("use super::{{{}, mat}};\n", concat!("port", "able"));
        assert_eq!(check_dispatch("cpu/isa/rows.rs", &sibling).len(), 1);
        let import = format!("use crate::{{{}, portable}};\n", concat!("av", "x512"));
        assert_eq!(check_dispatch("units.rs", &import).len(), 2);
        let detect = format!("let ok = std::arch::{}!(\"avx2\");\n", concat!("is_x86_feature", "_detected"));
        assert_eq!(check_dispatch("avx2.rs", &detect).len(), 1);
        assert!(check_dispatch("cpu_features.rs", &detect).is_empty());
        assert!(check_dispatch("cpu/isa/cpu_features.rs", &detect).is_empty());
    }

    #[test]
    fn cudarc_linking_modes_are_found_outside_comments() {
        let manifest = "cudarc = { features = [\"std\", \"fallback-dynamic-loading\"] }\n# \"dynamic-linking\"\n";
        assert!(check_cudarc_modes(manifest).is_empty(), "{:?}", check_cudarc_modes(manifest));
        let planted = manifest.replace("fallback-dynamic-loading", "dynamic-loading");
        assert_eq!(check_cudarc_modes(&planted).len(), 1);
        let call = format!("    if !cudarc::driver::sys::{}() {{\n", concat!("is_culib", "_present"));
        assert_eq!(check_cudarc_modes(&call).len(), 1);
    }

    #[test]
    fn the_history_word_is_found_as_a_word_only() {
        let w = HISTORY_WORD;
        let text = format!("ok line\nthe {w} ended\n{}S here\nthe {w}al flag and sub{w}\n", w.to_uppercase());
        let lines: Vec<usize> = check_history_words(&text).into_iter().map(|(l, _)| l).collect();
        assert_eq!(lines, vec![2, 3]);
    }

    #[test]
    fn each_rule_is_reported_with_its_line() {
        let src = format!(
            "fn f() {{\n    {}\n    let x = {} g() }};\n}}\n",
            concat!("dbg", "!(1);"),
            concat!("unsafe", " {")
        );
        let p = check_text(&src);
        assert!(p.iter().any(|(l, m)| *l == 1 && m.contains("//!")), "{p:?}");
        assert!(p.iter().any(|(l, m)| *l == 2 && m.contains("dbg")), "{p:?}");
        assert!(p.iter().any(|(l, m)| *l == 3 && m.contains("SAFETY")), "{p:?}");
        let long = format!("//! Docs.\n{}", "\n".repeat(MAX_LINES + 1));
        assert!(check_text(&long).iter().any(|(_, m)| m.contains("limit")));
        // A commented-out banned macro is fine; an attribute between comment and block is fine.
        let ok = format!(
            "//! D.\n// {}\n// SAFETY: ok\n#[allow(x)]\n{} impl Send for X {{}}\n",
            concat!("to", "do!()"),
            "unsafe"
        );
        assert!(check_text(&ok).is_empty(), "{:?}", check_text(&ok));
    }
}
