//! File circles: within one crate, no source file may import a file that imports it
//! back, directly or around a loop.
//!
//! The module tree is read from the `mod NAME;` declarations (with `#[path]`) from the
//! crate root; each file's imports are its `crate::`, `super::` and `self::` paths, in
//! `use` statements and inline. A path names the file of the deepest module it reaches;
//! a name that file only brings in with a `use` (a re-export) is followed to the file
//! that defines it, so `crate::Error` re-exported by `lib.rs` ties to `error.rs`.
//! A file is tied to the files it names, except its own parts (a module's `mod` and
//! `pub use` of its children are its face, not imports; a part naming its parent or a
//! sibling is an import), and the strongly connected groups of more than one file are
//! the circles.

mod rust_text;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use rust_text::{expand_use, inline_mods, inline_paths, is_reexport, mod_decls, module_at, strip, use_statements};

/// One crate's source files: each file's module path, and its imports.
struct Crate {
    /// Module path (`["cuda", "plan"]`) of every file.
    module_of: BTreeMap<PathBuf, Vec<String>>,
    /// The files that hold a module path (more than one where `cfg` picks between them).
    files_of: BTreeMap<Vec<String>, Vec<PathBuf>>,
    /// Each file's code with comments and string contents blanked.
    code: BTreeMap<PathBuf, String>,
}

impl Crate {
    /// Read the crate whose root file is `root` (`lib.rs` or `main.rs`).
    fn read(root: &Path) -> Result<Crate, String> {
        let mut c = Crate { module_of: BTreeMap::new(), files_of: BTreeMap::new(), code: BTreeMap::new() };
        let mut todo = vec![(root.to_path_buf(), Vec::<String>::new())];
        while let Some((file, module)) = todo.pop() {
            if c.module_of.contains_key(&file) {
                continue;
            }
            let raw = std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
            let code = strip(&raw);
            let dir = file.parent().unwrap_or(Path::new("")).to_path_buf();
            let stem = file.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
            let owns_dir = file == root || stem == "mod";
            let child_dir = if owns_dir { dir.clone() } else { dir.join(stem) };
            for (name, path) in mod_decls(&code, &raw) {
                let child = match path {
                    Some(p) => dir.join(p),
                    None if child_dir.join(format!("{name}.rs")).exists() => child_dir.join(format!("{name}.rs")),
                    None => child_dir.join(&name).join("mod.rs"),
                };
                if child.exists() {
                    let mut m = module.clone();
                    m.push(name);
                    todo.push((child, m));
                }
            }
            c.files_of.entry(module.clone()).or_default().push(file.clone());
            c.module_of.insert(file.clone(), module);
            c.code.insert(file, code);
        }
        Ok(c)
    }

    /// The files a path (already made absolute: module segments then names) ties to,
    /// following re-exports up to `depth` times.
    fn resolve(&self, segs: &[String], depth: usize) -> BTreeSet<PathBuf> {
        let mut at = segs.len();
        while at > 0 && !self.files_of.contains_key(&segs[..at]) {
            at -= 1;
        }
        let files = &self.files_of[&segs[..at]];
        let mut out = BTreeSet::new();
        for f in files {
            let followed = match segs.get(at) {
                Some(name) if depth > 0 => self.reexport(f, &segs[..at], name, depth - 1),
                _ => None,
            };
            match followed {
                Some(files) => out.extend(files),
                None => {
                    out.insert(f.clone());
                }
            }
        }
        out
    }

    /// Where the `use` statements of `file` (module `module`) bring `name` from: `None`
    /// when they do not bring it (it is defined there), an empty set when it comes from
    /// another crate.
    fn reexport(&self, file: &Path, module: &[String], name: &str, depth: usize) -> Option<BTreeSet<PathBuf>> {
        let mut out = BTreeSet::new();
        for (_, stmt) in use_statements(&self.code[file]) {
            for path in expand_use(&stmt) {
                let leaf = path.alias.as_deref().or(path.segs.last().map(String::as_str));
                if leaf != Some(name) {
                    continue;
                }
                match absolute(module, &path.segs, |m| self.files_of.contains_key(m)) {
                    Some(abs) => out.extend(self.resolve(&abs, depth)),
                    // Brought in from another crate: no file of this one.
                    None => return Some(BTreeSet::new()),
                }
            }
        }
        if out.is_empty() { None } else { Some(out) }
    }

    /// Each file's ties: the other files it names, with the names used.
    fn ties(&self) -> BTreeMap<PathBuf, BTreeMap<PathBuf, BTreeSet<String>>> {
        let mut ties: BTreeMap<PathBuf, BTreeMap<PathBuf, BTreeSet<String>>> = BTreeMap::new();
        for (file, code) in &self.code {
            let module = &self.module_of[file];
            let mods = inline_mods(code);
            // Each path with its offset and whether a `pub use` re-exports it.
            let mut paths: Vec<(usize, Vec<String>, bool)> = Vec::new();
            for (range, stmt) in use_statements(code) {
                let reexport = is_reexport(code, range.start);
                paths.extend(expand_use(&stmt).into_iter().map(|p| (range.start, p.segs, reexport)));
            }
            paths.extend(inline_paths(code).into_iter().map(|(at, segs)| (at, segs, false)));
            let module_len = module.len();
            let entry = ties.entry(file.clone()).or_default();
            for (at, segs, reexport) in paths {
                let module = module_at(module, &mods, at);
                let Some(abs) = absolute(&module, &segs, |m| self.files_of.contains_key(m)) else { continue };
                for target in self.resolve(&abs, 4) {
                    // A module re-exporting its own parts (`pub use` of a child) shows its
                    // face, not an import; its private `use` of a child and its inline
                    // paths into one are imports, as is a part naming its parent or a
                    // sibling, so a `mod.rs` and its children can close a circle too.
                    let part = reexport
                        && self
                            .module_of
                            .get(&target)
                            .is_some_and(|m| m.len() > module_len && m.starts_with(&module[..module_len]));
                    if &target != file && !part {
                        let shown = segs.last().cloned().unwrap_or_default();
                        entry.entry(target).or_default().insert(shown);
                    }
                }
            }
        }
        ties
    }
}

/// Make a path absolute from module `module`: `None` for paths outside the crate. A
/// path may start at `crate`, `self`, `super` or a child module of `module`.
fn absolute(module: &[String], segs: &[String], is_module: impl Fn(&[String]) -> bool) -> Option<Vec<String>> {
    let first = segs.first()?;
    let (mut base, rest) = match first.as_str() {
        "crate" => (Vec::new(), &segs[1..]),
        "self" => (module.to_vec(), &segs[1..]),
        "super" => {
            let mut base = module.to_vec();
            let mut k = 0;
            while segs.get(k).is_some_and(|s| s == "super") {
                base.pop()?;
                k += 1;
            }
            (base, &segs[k..])
        }
        child => {
            let mut m = module.to_vec();
            m.push(child.to_string());
            if !is_module(&m) {
                return None;
            }
            (module.to_vec(), segs)
        }
    };
    base.extend(rest.iter().filter(|s| *s != "*").cloned());
    Some(base)
}

/// The strongly connected groups of more than one node (Tarjan).
fn circles(ties: &BTreeMap<PathBuf, BTreeMap<PathBuf, BTreeSet<String>>>) -> Vec<Vec<PathBuf>> {
    struct State<'a> {
        ties: &'a BTreeMap<PathBuf, BTreeMap<PathBuf, BTreeSet<String>>>,
        index: BTreeMap<&'a PathBuf, usize>,
        low: BTreeMap<&'a PathBuf, usize>,
        stack: Vec<&'a PathBuf>,
        on_stack: BTreeSet<&'a PathBuf>,
        out: Vec<Vec<PathBuf>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a PathBuf) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        for w in s.ties.get(v).into_iter().flat_map(|m| m.keys()) {
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if s.on_stack.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut group = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                group.push(w.clone());
                if w == v {
                    break;
                }
            }
            if group.len() > 1 {
                group.sort();
                s.out.push(group);
            }
        }
    }
    let mut s = State {
        ties,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in ties.keys() {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.out.sort();
    s.out
}

/// The file circles of the crate in `dir` (its `src/lib.rs`, else `src/main.rs`), each
/// described as one line naming the files and the ties between them.
pub fn check_crate(dir: &Path) -> Result<Vec<String>, String> {
    let root = [dir.join("src/lib.rs"), dir.join("src/main.rs")].into_iter().find(|p| p.exists());
    let Some(root) = root else { return Ok(Vec::new()) };
    let krate = Crate::read(&root)?;
    let ties = krate.ties();
    let show = |p: &Path| p.strip_prefix(dir).unwrap_or(p).display().to_string();
    let mut found = Vec::new();
    for group in circles(&ties) {
        let members: BTreeSet<&PathBuf> = group.iter().collect();
        let mut parts = Vec::new();
        for from in &group {
            for (to, names) in &ties[from] {
                if members.contains(to) {
                    let names: Vec<&str> = names.iter().map(String::as_str).collect();
                    parts.push(format!("{} -> {} ({})", show(from), show(to), names.join(", ")));
                }
            }
        }
        found.push(format!("file circle of {} files: {}", group.len(), parts.join("; ")));
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::rust_text::strip_visibility;
    use super::*;

    /// Write a crate of `files` (path under `src/`, text) into a fresh directory.
    fn planted(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("temp dir");
        for (path, text) in files {
            let p = dir.path().join("src").join(path);
            std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
            std::fs::write(p, text).expect("write");
        }
        dir
    }

    const CLEAN: [(&str, &str); 5] = [
        ("lib.rs", "//! Root.\nmod error;\nmod plan;\nmod run;\npub use error::Error;\n"),
        ("error.rs", "//! Errors.\npub struct Error;\n"),
        ("plan/mod.rs", "//! Plans.\nmod route;\npub use route::Route;\npub struct Plan(crate::Error);\n"),
        ("plan/route.rs", "//! Routes.\nuse crate::Error;\npub struct Route;\n"),
        ("run.rs", "//! Runs.\nuse crate::{plan::{Plan, Route}, Error};\nfn f(_: super::plan::Plan) {}\n"),
    ];

    #[test]
    fn a_crate_without_circles_passes() {
        let dir = planted(&CLEAN);
        assert_eq!(check_crate(dir.path()).expect("read"), Vec::<String>::new());
    }

    #[test]
    fn a_direct_circle_fails() {
        let mut files = CLEAN.to_vec();
        files[3] = ("plan/route.rs", "//! Routes.\nuse crate::run::helper;\npub struct Route;\n");
        let dir = planted(&files);
        let found = check_crate(dir.path()).expect("read");
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("plan/route.rs -> src/run.rs (helper)"), "{found:?}");
        assert!(found[0].contains("src/run.rs -> src/plan/route.rs (Route)"), "{found:?}");
    }

    #[test]
    fn a_circle_around_a_loop_through_an_inline_path_and_super_fails() {
        let mut files = CLEAN.to_vec();
        // error -> run (inline path) -> plan/route (through the re-export) -> error.
        files[1] = ("error.rs", "//! Errors.\npub struct Error;\nfn f() { crate::run::go(); }\n");
        files[3] = ("plan/route.rs", "//! Routes.\nuse super::super::error::Error;\npub struct Route;\n");
        let dir = planted(&files);
        let found = check_crate(dir.path()).expect("read");
        assert_eq!(found.len(), 1, "{found:?}");
        // plan/mod.rs joins through its `crate::Error`.
        assert!(found[0].starts_with("file circle of 4 files"), "{found:?}");
        assert!(found[0].contains("src/error.rs -> src/run.rs (go)"), "{found:?}");
        assert!(found[0].contains("src/plan/route.rs -> src/error.rs (Error)"), "{found:?}");
    }

    #[test]
    fn comments_strings_and_test_modules_do_not_tie() {
        let mut files = CLEAN.to_vec();
        files[3] = (
            "plan/route.rs",
            "//! Routes, see crate::run::x.\n// crate::run::y\nconst S: &str = \"crate::run::z\";\npub struct Route;\n#[cfg(test)]\nmod tests {\n    use super::*;\n}\n",
        );
        let dir = planted(&files);
        assert_eq!(check_crate(dir.path()).expect("read"), Vec::<String>::new());
    }

    #[test]
    fn restricted_modules_are_read() {
        let mut files = CLEAN.to_vec();
        files[2] = ("plan/mod.rs", "//! Plans.\npub(super) mod route;\npub use route::Route;\npub struct Plan;\n");
        files[3] =
            ("plan/route.rs", "//! Routes.\npub(in crate::plan) fn r() { crate::run::go(); }\npub struct Route;\n");
        let dir = planted(&files);
        let found = check_crate(dir.path()).expect("read");
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("plan/route.rs -> src/run.rs (go)"), "{found:?}");
        assert_eq!(strip_visibility("pub(in super::super) mod x;"), "mod x;");
        // A visibility path is no tie: route.rs restricting to `crate::plan` while
        // plan/mod.rs calls into route.rs closes no circle.
        files[2] = ("plan/mod.rs", "//! Plans.\nmod route;\npub struct Plan;\nfn f() { route::r(); }\n");
        files[3] = ("plan/route.rs", "//! Routes.\npub(in crate::plan) fn r() {}\npub struct Route;\n");
        let dir = planted(&files);
        assert_eq!(check_crate(dir.path()).expect("read"), Vec::<String>::new());
        assert_eq!(strip_visibility("public mod x;"), "public mod x;");
    }

    #[test]
    fn a_module_and_its_child_importing_each_other_fail() {
        // plan/mod.rs uses its child's `Route` in its own code, and route.rs uses
        // `Plan`, defined in plan/mod.rs: a circle even though one is the other's part.
        let mut files = CLEAN.to_vec();
        files[2] =
            ("plan/mod.rs", "//! Plans.\nmod route;\nuse route::Route;\npub struct Plan(Route);\npub fn go() {}\n");
        files[3] = ("plan/route.rs", "//! Routes.\nuse super::go;\npub struct Route;\n");
        files[4] = ("run.rs", "//! Runs.\nfn f(_: super::plan::Plan) {}\n");
        let dir = planted(&files);
        let found = check_crate(dir.path()).expect("read");
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("src/plan/mod.rs -> src/plan/route.rs (Route)"), "{found:?}");
        assert!(found[0].contains("src/plan/route.rs -> src/plan/mod.rs (go)"), "{found:?}");
        // The same through an inline path in the parent.
        files[2] = ("plan/mod.rs", "//! Plans.\nmod route;\npub struct Plan;\npub fn go() { route::r(); }\n");
        files[3] = ("plan/route.rs", "//! Routes.\npub fn r() { super::go(); }\n");
        let dir = planted(&files);
        let found = check_crate(dir.path()).expect("read");
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("src/plan/mod.rs -> src/plan/route.rs (r)"), "{found:?}");
    }

    #[test]
    fn a_reexport_of_a_child_is_not_an_import() {
        // plan/mod.rs re-exports `Route` and defines `Plan`, which route.rs uses.
        let mut files = CLEAN.to_vec();
        files[2] = ("plan/mod.rs", "//! Plans.\nmod route;\npub use route::Route;\npub struct Plan;\n");
        files[3] = ("plan/route.rs", "//! Routes.\nuse super::Plan;\npub struct Route(Plan);\n");
        let dir = planted(&files);
        assert_eq!(check_crate(dir.path()).expect("read"), Vec::<String>::new());
        assert!(is_reexport("x;\n    pub(crate) use a::b;", 18));
        assert!(!is_reexport("x;\n    use a::b;", 7));
    }

    #[test]
    fn use_trees_expand_with_aliases_and_self() {
        let paths: Vec<(String, Option<String>)> =
            expand_use("crate::{a::B, c::{self, D as E}}").into_iter().map(|p| (p.segs.join("::"), p.alias)).collect();
        let want = [("crate::a::B", None), ("crate::c", None), ("crate::c::D", Some("E".to_string()))];
        let want: Vec<(String, Option<String>)> = want.into_iter().map(|(p, a)| (p.to_string(), a)).collect();
        assert_eq!(paths, want);
    }
}
