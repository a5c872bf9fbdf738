//! Reading Rust source text without a parser: comments and literals blanked, `mod`
//! declarations, `use` trees and inline paths found by their tokens.

/// Blank comments, string and char literal contents, keeping line structure.
pub(super) fn strip(text: &str) -> String {
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
pub(super) fn strip_visibility(t: &str) -> &str {
    let Some(rest) = t.strip_prefix("pub") else { return t };
    let rest = match rest.strip_prefix('(') {
        Some(inner) => inner.split_once(')').map_or(rest, |(_, after)| after),
        None => rest,
    };
    if rest.starts_with(char::is_whitespace) { rest.trim_start() } else { t }
}

/// The `mod NAME;` declarations of a file's code, each with its `#[path]` if any.
pub(super) fn mod_decls(code: &str, raw: &str) -> Vec<(String, Option<String>)> {
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

/// One path of a `use` tree, with its `as` name.
pub(super) struct UsePath {
    pub(super) segs: Vec<String>,
    pub(super) alias: Option<String>,
}

/// Every `use` statement in `code` (from `use` to its `;`, any line count): its byte
/// range and its text.
pub(super) fn use_statements(code: &str) -> Vec<(std::ops::Range<usize>, String)> {
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
pub(super) fn is_reexport(code: &str, at: usize) -> bool {
    let line_start = code[..at].rfind('\n').map_or(0, |i| i + 1);
    code[line_start..at].trim().starts_with("pub")
}

/// The inline `mod NAME { .. }` blocks of `code`: byte range and name.
pub(super) fn inline_mods(code: &str) -> Vec<(std::ops::Range<usize>, String)> {
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
pub(super) fn module_at(module: &[String], mods: &[(std::ops::Range<usize>, String)], at: usize) -> Vec<String> {
    let mut m = module.to_vec();
    m.extend(mods.iter().filter(|(r, _)| r.contains(&at)).map(|(_, n)| n.clone()));
    m
}

/// Expand a use tree (`crate::{a::B, c::{D as E, self}}`) into its paths.
pub(super) fn expand_use(tree: &str) -> Vec<UsePath> {
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
pub(super) fn inline_paths(code: &str) -> Vec<(usize, Vec<String>)> {
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
