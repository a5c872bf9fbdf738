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

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// One crate's source files: each file's module path, and its imports.
struct Crate {
    /// Module path (`["cuda", "plan"]`) of every file.
    module_of: BTreeMap<PathBuf, Vec<String>>,
    /// The files that hold a module path (more than one where `cfg` picks between them).
    files_of: BTreeMap<Vec<String>, Vec<PathBuf>>,
    /// Each file's code with comments and string contents blanked.
    code: BTreeMap<PathBuf, String>,
}

/// Blank comments, string and char literal contents, keeping line structure.
fn strip(text: &str) -> String {
    let b: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if b[i] == '\n' {
                        out.push('\n');
                    }
                    i += 1;
                }
            }
        } else if c == '"' {
            out.push('"');
            i += 1;
            while i < b.len() && b[i] != '"' {
                if b[i] == '\\' {
                    i += 1;
                }
                if b.get(i) == Some(&'\n') {
                    out.push('\n');
                }
                i += 1;
            }
            out.push('"');
            i += 1;
        } else if c == '\'' && next.is_some_and(|n| n != '\\') && b.get(i + 2) == Some(&'\'') {
            out.push_str("' '");
            i += 3;
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// `t` without a leading `pub`, `pub(crate)`, `pub(super)` or `pub(in PATH)`.
fn strip_visibility(t: &str) -> &str {
    let Some(rest) = t.strip_prefix("pub") else { return t };
    let rest = match rest.strip_prefix('(') {
        Some(inner) => inner.split_once(')').map_or(rest, |(_, after)| after),
        None => rest,
    };
    if rest.starts_with(char::is_whitespace) { rest.trim_start() } else { t }
}

/// The `mod NAME;` declarations of a file's code, each with its `#[path]` if any.
fn mod_decls(code: &str, raw: &str) -> Vec<(String, Option<String>)> {
    let raw_lines: Vec<&str> = raw.lines().collect();
    let mut out = Vec::new();
    for (i, line) in code.lines().enumerate() {
        let t = line.trim();
        let t = strip_visibility(t);
        let Some(rest) = t.strip_prefix("mod ") else { continue };
        let Some(name) = rest.strip_suffix(';') else { continue };
        let mut path = None;
        let mut j = i;
        while j > 0 {
            j -= 1;
            let above = raw_lines.get(j).map_or("", |l| l.trim());
            if let Some(p) = above.strip_prefix("#[path = \"").and_then(|p| p.strip_suffix("\"]")) {
                path = Some(p.to_string());
            } else if !above.starts_with("#[") {
                break;
            }
        }
        out.push((name.trim().to_string(), path));
    }
    out
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

/// One path of a `use` tree, with its `as` name.
struct UsePath {
    segs: Vec<String>,
    alias: Option<String>,
}

/// Every `use` statement in `code` (from `use` to its `;`, any line count): its byte
/// range and its text.
fn use_statements(code: &str) -> Vec<(std::ops::Range<usize>, String)> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(found) = code[from..].find("use ") {
        let at = from + found;
        let before = code[..at].chars().next_back();
        let word_start = before.is_none_or(|c| !(c.is_alphanumeric() || c == '_'));
        let body = at + 4;
        match code[body..].find(';') {
            Some(end) if word_start => {
                let stmt = &code[body..body + end];
                if !stmt.contains('(') && !stmt.contains('=') {
                    out.push((at..body + end, stmt.trim().to_string()));
                }
                from = body + end;
            }
            _ => from = body,
        }
    }
    out
}

/// Whether the `use` statement at byte `at` of `code` is a re-export (`pub use`,
/// `pub(crate) use`, ..): the text between the line start and `use` begins with `pub`.
fn is_reexport(code: &str, at: usize) -> bool {
    let line_start = code[..at].rfind('\n').map_or(0, |i| i + 1);
    code[line_start..at].trim().starts_with("pub")
}

/// The inline `mod NAME { .. }` blocks of `code`: byte range and name.
fn inline_mods(code: &str) -> Vec<(std::ops::Range<usize>, String)> {
    let bytes = code.as_bytes();
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(found) = code[from..].find("mod ") {
        let at = from + found;
        from = at + 4;
        let word_start = at == 0 || !(bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_');
        let rest = &code[at + 4..];
        let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        let after = rest[name.len()..].trim_start();
        if !word_start || name.is_empty() || !after.starts_with('{') {
            continue;
        }
        let open = at + 4 + name.len() + (rest[name.len()..].len() - after.len());
        let mut depth = 0usize;
        let mut end = code.len();
        for (i, b) in bytes.iter().enumerate().skip(open) {
            match b {
                b'{' => depth += 1,
                b'}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = i;
                        break;
                    }
                }
                _ => {}
            }
        }
        out.push((open..end, name));
    }
    out
}

/// The module at byte `at` of a file of module `module`: the file's, plus the inline
/// modules around `at`.
fn module_at(module: &[String], mods: &[(std::ops::Range<usize>, String)], at: usize) -> Vec<String> {
    let mut m = module.to_vec();
    m.extend(mods.iter().filter(|(r, _)| r.contains(&at)).map(|(_, n)| n.clone()));
    m
}

/// Expand a use tree (`crate::{a::B, c::{D as E, self}}`) into its paths.
fn expand_use(tree: &str) -> Vec<UsePath> {
    fn walk(prefix: &[String], t: &str, out: &mut Vec<UsePath>) {
        let t = t.trim();
        if t.is_empty() {
            return;
        }
        if let Some(open) = t.find('{') {
            let mut segs = prefix.to_vec();
            segs.extend(t[..open].split("::").map(str::trim).filter(|s| !s.is_empty()).map(String::from));
            let inner = &t[open + 1..t.rfind('}').unwrap_or(t.len())];
            let mut depth = 0;
            let mut start = 0;
            for (i, ch) in inner.char_indices() {
                match ch {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        walk(&segs, &inner[start..i], out);
                        start = i + 1;
                    }
                    _ => {}
                }
            }
            walk(&segs, &inner[start..], out);
            return;
        }
        let (path, alias) = match t.split_once(" as ") {
            Some((p, a)) => (p.trim(), Some(a.trim().to_string())),
            None => (t, None),
        };
        let mut segs = prefix.to_vec();
        for s in path.split("::").map(str::trim).filter(|s| !s.is_empty()) {
            if s != "self" || segs.is_empty() {
                segs.push(s.to_string());
            }
        }
        out.push(UsePath { segs, alias });
    }
    let t = tree.trim();
    let t = strip_visibility(t);
    let t = t.trim_start_matches("::");
    let mut out = Vec::new();
    walk(&[], t, &mut out);
    out
}

/// Paths of two or more segments outside `use` statements, each with its byte offset
/// (`absolute` keeps those that name a module of the crate).
fn inline_paths(code: &str) -> Vec<(usize, Vec<String>)> {
    let uses: Vec<std::ops::Range<usize>> = use_statements(code).into_iter().map(|(r, _)| r).collect();
    let bytes = code.as_bytes();
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let starts_word = i == 0 || !(ident(bytes[i - 1]) || bytes[i - 1] == b'$' || bytes[i - 1] == b':');
        if starts_word && ident(bytes[i]) {
            let mut segs = Vec::new();
            let mut j = i;
            loop {
                let s = j;
                while j < bytes.len() && ident(bytes[j]) {
                    j += 1;
                }
                segs.push(code[s..j].to_string());
                let more = bytes.get(j) == Some(&b':')
                    && bytes.get(j + 1) == Some(&b':')
                    && bytes.get(j + 2).is_some_and(|c| ident(*c));
                if !more {
                    break;
                }
                j += 2;
            }
            let in_use = uses.iter().any(|r| r.contains(&i));
            // `pub(in super::super)` restricts a visibility; it imports nothing.
            let before = code[..i].trim_end();
            let visibility = before.strip_suffix("in").is_some_and(|b| b.trim_end().ends_with("pub("));
            if !in_use && !visibility && segs.len() > 1 {
                out.push((i, segs));
            }
            i = j.max(i + 1);
        } else {
            i += 1;
        }
    }
    out
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
