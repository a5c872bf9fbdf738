//! Command-line options of the conformance runner.

use std::path::PathBuf;

pub const USAGE: &str =
    "usage: attn-golden DIR [--backend reference|cpu|ring|cuda|candle|burn] [--dtype f32|bf16|f16|f64]
                   [--threads T] [--world-size N] [--strategy ring|allgather|auto|ulysses|hybrid] [--ulysses U]
                   [--layout contiguous|zigzag]   (hybrid: groups of U ranks, U dividing N)
                   [--expect N]   (fail unless DIR holds exactly N cases)
                   [--expect-refused R]   (fail unless exactly R cases are refused as unsupported; default 0)
exit status: 0 passed, 1 a case failed or the count is off, 2 usage, 3 backend unavailable here,
             4 backend not compiled in";

/// Parsed options.
#[derive(Debug, Clone)]
pub struct Options {
    pub dir: PathBuf,
    pub backend: String,
    pub dtype: String,
    pub threads: usize,
    pub world_size: Option<usize>,
    /// The strategy as `attn_ring::Strategy::parse` reads it (`hybrid:U` with `--ulysses U`).
    pub strategy: String,
    pub layout: String,
    /// The number of cases DIR must hold (`--expect N`).
    pub expect: Option<usize>,
    /// The number of cases the backend must refuse as unsupported (`--expect-refused R`).
    pub expect_refused: usize,
}

impl Options {
    pub fn parse(mut args: impl Iterator<Item = String>) -> Result<Self, String> {
        let mut dir = None;
        let mut ulysses = None;
        let mut o = Options {
            dir: PathBuf::new(),
            backend: "reference".into(),
            dtype: "f32".into(),
            threads: 0,
            world_size: None,
            strategy: "auto".into(),
            layout: "contiguous".into(),
            expect: None,
            expect_refused: 0,
        };
        while let Some(a) = args.next() {
            let mut value = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
            match a.as_str() {
                "--backend" => o.backend = value("--backend")?,
                "--dtype" => o.dtype = value("--dtype")?,
                "--threads" => o.threads = parse_num(&value("--threads")?)?,
                "--world-size" => o.world_size = Some(parse_num(&value("--world-size")?)?),
                "--strategy" => o.strategy = value("--strategy")?,
                "--ulysses" => ulysses = Some(parse_num(&value("--ulysses")?)?),
                "--layout" => o.layout = value("--layout")?,
                "--expect" => o.expect = Some(parse_num(&value("--expect")?)?),
                "--expect-refused" => o.expect_refused = parse_num(&value("--expect-refused")?)?,
                "-h" | "--help" => return Err("help".into()),
                s if s.starts_with('-') => return Err(format!("unknown option `{s}`")),
                s if dir.is_none() => dir = Some(PathBuf::from(s)),
                s => return Err(format!("unexpected argument `{s}`")),
            }
        }
        o.dir = dir.ok_or("DIR is required")?;
        // `--ulysses U` sets a hybrid's degree (with `ulysses`, U is the world size).
        match (o.strategy.to_ascii_lowercase().as_str(), ulysses) {
            ("hybrid", Some(u)) => o.strategy = format!("hybrid:{u}"),
            ("hybrid", None) => return Err("--strategy hybrid needs --ulysses U".into()),
            ("ulysses", Some(u)) if Some(u) != o.world_size => {
                return Err(format!(
                    "--strategy ulysses is over the whole world: --ulysses {u} needs --world-size {u}"
                ));
            }
            ("ulysses", _) | (_, None) => {}
            (s, Some(_)) => return Err(format!("--ulysses needs --strategy ulysses or hybrid, not `{s}`")),
        }
        if o.world_size == Some(0) {
            return Err("--world-size must be at least 1".into());
        }
        Ok(o)
    }
}

fn parse_num(s: &str) -> Result<usize, String> {
    s.parse().map_err(|_| format!("`{s}` is not a number"))
}
