//! `#ODFS` directives in a batch script: what a job asks of its filesystem.
//!
//! ```text
//! #!/bin/bash
//! #SBATCH --constraint=odfs
//! #ODFS stage-in  s3://datasets/imagenet /data --seal
//! #ODFS stage-out /out s3://runs/%u/%j
//! #ODFS drain /ckpt s3://runs/%u/%j/ckpt --settle 5 --keep 3
//! #ODFS stripe-count 4
//! #ODFS chunk-size 4M
//! #ODFS placement local
//! ```
//!
//! Like `#SBATCH`, directives are read from the script's first block of comments: an `#ODFS`
//! line after the first command is an error (it would otherwise be silently ignored). `%j`
//! and `%u` expand to the job id and user name. Arguments are separated by blanks; single or
//! double quotes keep blanks inside one argument.

use odfs_proto::units::parse_size;
use serde::{Deserialize, Serialize};

/// One transfer: source and destination as `odfs stage-in/stage-out` take them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Transfer {
    pub src: String,
    pub dst: String,
    /// Stage-in only: seal the destination once it is verified (`--seal`).
    #[serde(default)]
    pub seal: bool,
}

/// A continuous drain (`drain SRC DST [--settle SECS] [--keep K] [--marker NAME]
/// [--concurrency N] [--max-bandwidth SIZE] [--share PCT] [--delete-after-upload]`): SRC's settled files
/// uploaded to DST while the job runs. A drain also stages SRC out to DST at the end, like
/// `stage-out SRC DST`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Drain {
    pub src: String,
    pub dst: String,
    pub settle: Option<f64>,
    #[serde(default)]
    pub keep: u32,
    #[serde(default)]
    pub marker: Option<String>,
    pub concurrency: Option<u32>,
    pub max_bandwidth: Option<u64>,
    /// The share as a fraction (0.2 for `--share 20`).
    #[serde(default)]
    pub share: Option<f64>,
    #[serde(default)]
    pub delete_after_upload: bool,
}

/// Everything `#ODFS` lines can ask for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct Directives {
    pub stage_in: Vec<Transfer>,
    pub stage_out: Vec<Transfer>,
    pub drain: Vec<Drain>,
    pub stripe_count: Option<i32>,
    pub chunk_size: Option<u32>,
    pub pool: Option<String>,
    /// Local placement for the filesystem's default layout (`placement local|rotate`).
    pub local_placement: Option<bool>,
    /// S3 settings for this job's stages (the site's `[stage]` table otherwise).
    pub endpoint_url: Option<String>,
    pub region: Option<String>,
    pub path_style: bool,
    pub concurrency: Option<u32>,
    pub max_bandwidth: Option<u64>,
    /// AWS profile of the job user's own credentials to stage with.
    pub profile: Option<String>,
}

impl Directives {
    /// What the directives ask for, in a few words ("2 stage-in, 1 stage-out, stripe-count 4").
    pub fn summary(&self) -> String {
        let mut parts = Vec::new();
        if !self.stage_in.is_empty() {
            parts.push(format!("{} stage-in", self.stage_in.len()));
        }
        if !self.stage_out.is_empty() {
            parts.push(format!("{} stage-out", self.stage_out.len()));
        }
        if !self.drain.is_empty() {
            parts.push(format!("{} drain", self.drain.len()));
        }
        if let Some(n) = self.stripe_count {
            parts.push(format!("stripe-count {n}"));
        }
        if let Some(c) = self.chunk_size {
            parts.push(format!("chunk-size {c}"));
        }
        if let Some(p) = &self.pool {
            parts.push(format!("pool {p}"));
        }
        if let Some(l) = self.local_placement {
            parts.push(format!("placement {}", if l { "local" } else { "rotate" }));
        }
        if parts.is_empty() {
            "no #ODFS directives that change the defaults".into()
        } else {
            parts.join(", ")
        }
    }
}

/// The help text listing every directive (printed with errors).
pub const HELP: &str = "stage-in SRC DST [--seal] | stage-out SRC DST | \
                        drain SRC DST [--settle SECS] [--keep K] [--marker NAME] [--concurrency N] [--max-bandwidth SIZE] [--share PCT] [--delete-after-upload] | stripe-count N | chunk-size SIZE | pool NAME | placement local|rotate | \
                        endpoint-url URL | region NAME | path-style | profile NAME | concurrency N | max-bandwidth SIZE";

/// Splits one directive's arguments (blanks; quotes group). An unquoted `#` that starts a word
/// starts a comment to the end of the line, as in the shell the script is written for (`#ODFS
/// stage-out /out s3://b/out   # the results`); one inside a word (`s3://b/a#1`) is kept.
fn words(s: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut cur: Option<String> = None;
    let mut quote: Option<char> = None;
    for c in s.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => cur.get_or_insert_with(String::new).push(c),
            (None, '#') if cur.is_none() => break,
            (None, '"' | '\'') => {
                quote = Some(c);
                cur.get_or_insert_with(String::new);
            }
            (None, c) if c.is_whitespace() => {
                if let Some(w) = cur.take() {
                    out.push(w);
                }
            }
            (None, c) => cur.get_or_insert_with(String::new).push(c),
        }
    }
    if quote.is_some() {
        return Err("a quote is not closed".into());
    }
    out.extend(cur);
    Ok(out)
}

fn expand(s: &str, job: &str, user: &str) -> String {
    crate::site::expand(s, job, user, "%n")
}

/// An odfs path as a directive names it: `/data` or `odfs:/data`.
fn odfs_path(s: &str) -> Result<String, String> {
    let p = s.strip_prefix("odfs:").unwrap_or(s);
    if !p.starts_with('/') {
        return Err(format!("{s:?} is not a path in the job's filesystem (write /data or odfs:/data)"));
    }
    if p.split('/').any(|c| c == "..") {
        return Err(format!("{s:?} must not contain '..'"));
    }
    Ok(format!("odfs:{p}"))
}

/// The shared-store side: `s3://bucket/prefix` or an absolute POSIX path.
fn store_path(s: &str) -> Result<String, String> {
    if let Some(rest) = s.strip_prefix("s3://") {
        if rest.is_empty() || rest.starts_with('/') {
            return Err(format!("{s:?} names no bucket (s3://BUCKET/PREFIX)"));
        }
        return Ok(s.to_string());
    }
    if s.starts_with('/') {
        return Ok(s.to_string());
    }
    Err(format!("{s:?} is neither s3://BUCKET/PREFIX nor an absolute path"))
}

fn one_directive(d: &mut Directives, w: &[String]) -> Result<(), String> {
    let name = w[0].as_str();
    let args = &w[1..];
    let want = |n: usize, form: &str| -> Result<(), String> {
        if args.len() == n {
            Ok(())
        } else {
            Err(format!("{name} takes {form}"))
        }
    };
    match name {
        "stage-in" => {
            let seal = args.last().is_some_and(|a| a == "--seal");
            let args = &args[..args.len() - seal as usize];
            if args.len() != 2 {
                return Err("stage-in takes a source (s3://... or /path), a destination in the job's filesystem, \
                     and --seal to seal the destination read-only once it is verified"
                    .into());
            }
            d.stage_in.push(Transfer { src: store_path(&args[0])?, dst: odfs_path(&args[1])?, seal });
        }
        "stage-out" => {
            want(2, "a source in the job's filesystem and a destination (s3://... or /path)")?;
            d.stage_out.push(Transfer { src: odfs_path(&args[0])?, dst: store_path(&args[1])?, seal: false });
        }
        "drain" => {
            let dr = drain(args)?;
            let out = Transfer { src: dr.src.clone(), dst: dr.dst.clone(), seal: false };
            if !d.stage_out.contains(&out) {
                d.stage_out.push(out);
            }
            d.drain.push(dr);
        }
        "stripe-count" => {
            want(1, "a number of targets (-1 = every target)")?;
            let n: i32 = args[0].parse().map_err(|_| format!("stripe-count {:?} is not a number", args[0]))?;
            if n == 0 || n < -1 {
                return Err(format!("stripe-count {n}: use a positive count or -1 (every target)"));
            }
            d.stripe_count = Some(n);
        }
        "chunk-size" => {
            want(1, "a size (e.g. 1M)")?;
            let v = parse_size(&args[0])?;
            if v < 65536 || !v.is_power_of_two() || v > 1 << 30 {
                return Err(format!("chunk-size {}: must be a power of two from 64K to 1G", args[0]));
            }
            d.chunk_size = Some(v as u32);
        }
        "pool" => {
            want(1, "a pool name")?;
            d.pool = Some(args[0].clone());
        }
        "placement" => {
            want(1, "local (a new file's first stripe on its writer's node) or rotate")?;
            d.local_placement = Some(odfs_proto::layout::parse_placement(&args[0])?);
        }
        "endpoint-url" => {
            want(1, "a URL")?;
            if !(args[0].starts_with("http://") || args[0].starts_with("https://")) {
                return Err(format!("endpoint-url {:?} must start with http:// or https://", args[0]));
            }
            d.endpoint_url = Some(args[0].clone());
        }
        "region" => {
            want(1, "a region name")?;
            d.region = Some(args[0].clone());
        }
        "path-style" => {
            want(0, "no argument")?;
            d.path_style = true;
        }
        "profile" => {
            want(1, "the name of a profile in your ~/.aws/credentials or ~/.aws/config")?;
            d.profile = Some(args[0].clone());
        }
        "concurrency" => {
            want(1, "a number of transfers per node")?;
            let n: u32 = args[0]
                .parse()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| format!("concurrency {:?} is not a positive number", args[0]))?;
            d.concurrency = Some(n);
        }
        "max-bandwidth" => {
            want(1, "bytes per second (e.g. 500M)")?;
            d.max_bandwidth = Some(parse_size(&args[0])?);
        }
        other => return Err(format!("unknown directive {other:?} (known: {HELP})")),
    }
    Ok(())
}

/// `drain SRC DST [options]`.
fn drain(args: &[String]) -> Result<Drain, String> {
    const FORM: &str = "drain takes a source in the job's filesystem, an s3://BUCKET/PREFIX, then any of \
                        --settle SECS, --keep K, --marker NAME, --concurrency N, --max-bandwidth SIZE, --share PCT, --delete-after-upload";
    if args.len() < 2 || args[0].starts_with("--") || args[1].starts_with("--") {
        return Err(FORM.into());
    }
    let dst = store_path(&args[1])?;
    if !dst.starts_with("s3://") {
        return Err(format!("drain {:?}: a drain uploads to s3://BUCKET/PREFIX", args[1]));
    }
    let mut dr = Drain {
        src: odfs_path(&args[0])?,
        dst,
        settle: None,
        keep: 0,
        marker: None,
        concurrency: None,
        max_bandwidth: None,
        share: None,
        delete_after_upload: false,
    };
    let mut rest = args[2..].iter();
    while let Some(opt) = rest.next() {
        if opt == "--delete-after-upload" {
            dr.delete_after_upload = true;
            continue;
        }
        let value = rest.next().ok_or_else(|| format!("drain {opt} needs a value ({FORM})"))?;
        match opt.as_str() {
            "--settle" => {
                let v: f64 =
                    value.parse().map_err(|_| format!("drain --settle {value:?} is not a number of seconds"))?;
                if !(0.0..=86_400.0).contains(&v) {
                    return Err(format!("drain --settle {value}: from 0 to 86400 seconds"));
                }
                dr.settle = Some(v);
            }
            "--keep" => {
                dr.keep =
                    value.parse().map_err(|_| format!("drain --keep {value:?} is not a number of checkpoints"))?;
            }
            "--marker" => {
                odfs_stage::drain::check_marker(value).map_err(|e| format!("drain {e}"))?;
                dr.marker = Some(value.clone());
            }
            "--concurrency" => {
                let n: u32 = value
                    .parse()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| format!("drain --concurrency {value:?} is not a positive number"))?;
                dr.concurrency = Some(n);
            }
            "--max-bandwidth" => dr.max_bandwidth = Some(parse_size(value)?),
            "--share" => dr.share = Some(odfs_stage::drain::parse_share(value).map_err(|e| format!("drain --{e}"))?),
            other => return Err(format!("drain: unknown option {other:?} ({FORM})")),
        }
    }
    Ok(dr)
}

/// Parses the `#ODFS` lines of a batch script. Errors name the line: `line 4: ...`.
pub fn parse(script: &str, job: &str, user: &str) -> Result<Directives, String> {
    parse_all(script, job, user).map_err(|errors| match errors.as_slice() {
        [one] => one.clone(),
        [first, rest @ ..] => {
            format!("{first} (and {} more bad #ODFS lines: `odfs check-script` lists them)", rest.len())
        }
        [] => unreachable!("an error has at least one line"),
    })
}

/// [`parse`], with every bad line's error (each names its line), not only the first.
pub fn parse_all(script: &str, job: &str, user: &str) -> Result<Directives, Vec<String>> {
    let mut d = Directives::default();
    let mut errors = Vec::new();
    let mut header = true;
    for (i, line) in script.lines().enumerate() {
        let t = line.trim();
        if let Some(rest) = t.strip_prefix("#ODFS") {
            if let Err(e) = directive_line(&mut d, rest, header, job, user) {
                errors.push(format!("line {}: `{t}`: {e}", i + 1));
            }
        } else if !(t.is_empty() || t.starts_with('#')) {
            header = false;
        }
    }
    match errors.is_empty() {
        true => Ok(d),
        false => Err(errors),
    }
}

/// One `#ODFS` line, `rest` the text after `#ODFS`, into `d`.
fn directive_line(d: &mut Directives, rest: &str, header: bool, job: &str, user: &str) -> Result<(), String> {
    if !rest.is_empty() && !rest.starts_with(char::is_whitespace) {
        return Err("write `#ODFS directive args`".into());
    }
    if !header {
        return Err("#ODFS lines must come before the script's first command, as #SBATCH lines do".into());
    }
    let w = words(&expand(rest, job, user))?;
    if w.is_empty() {
        return Err(format!("no directive (known: {HELP})"));
    }
    one_directive(d, &w)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_directive() {
        let s = "#!/bin/bash\n#SBATCH -N 4\n#ODFS stage-in s3://ds/imagenet /data\n#ODFS stage-in /pfs/x odfs:/x\n\
                 #ODFS stage-out /out s3://runs/%u/run-%j\n#ODFS stripe-count -1\n#ODFS chunk-size 4M\n#ODFS pool ram\n\
                 #ODFS placement local\n#ODFS endpoint-url http://s3:9000\n#ODFS region eu-1\n  #ODFS path-style\n#ODFS profile lab\n#ODFS concurrency 8\n\
                 #ODFS max-bandwidth 1G\n#ODFS stage-in 's3://b/with space' \"/my data\" --seal\nsrun train.py\n# #ODFS in a comment later is fine\n";
        let d = parse(s, "42", "ana").unwrap();
        assert_eq!(d.stage_in[0], Transfer { src: "s3://ds/imagenet".into(), dst: "odfs:/data".into(), seal: false });
        assert_eq!(d.stage_in[1], Transfer { src: "/pfs/x".into(), dst: "odfs:/x".into(), seal: false });
        assert_eq!(
            d.stage_in[2],
            Transfer { src: "s3://b/with space".into(), dst: "odfs:/my data".into(), seal: true }
        );
        assert_eq!(
            d.stage_out[0],
            Transfer { src: "odfs:/out".into(), dst: "s3://runs/ana/run-42".into(), seal: false }
        );
        assert_eq!((d.stripe_count, d.chunk_size, d.pool.as_deref()), (Some(-1), Some(4 << 20), Some("ram")));
        assert_eq!(d.local_placement, Some(true));
        assert_eq!(parse("#ODFS placement rotate\n", "1", "u").unwrap().local_placement, Some(false));
        assert!(parse("#ODFS placement near\n", "1", "u").unwrap_err().contains("use local or rotate"));
        assert_eq!(
            (d.endpoint_url.as_deref(), d.region.as_deref(), d.path_style),
            (Some("http://s3:9000"), Some("eu-1"), true)
        );
        assert_eq!((d.concurrency, d.max_bandwidth, d.profile.as_deref()), (Some(8), Some(1 << 30), Some("lab")));
        assert_eq!(parse("#!/bin/sh\necho hi\n", "1", "u").unwrap(), Directives::default());
    }

    #[test]
    fn a_comment_ends_a_directive_as_in_the_shell() {
        let d = parse(
            "#ODFS stage-in s3://ds/imagenet /data --seal   # on every node, verified\n\
             #ODFS stage-out /results s3://runs/%u/%j # after the job\n\
             #ODFS drain /ckpt s3://runs/%j/ckpt --keep 3 #each checkpoint\n\
             #ODFS stage-in 's3://b/x # y' /a#1\n#ODFS pool ram#2\n",
            "9",
            "ana",
        )
        .unwrap();
        assert_eq!(d.stage_in[0], Transfer { src: "s3://ds/imagenet".into(), dst: "odfs:/data".into(), seal: true });
        assert_eq!(d.stage_out[0].dst, "s3://runs/ana/9");
        assert_eq!((d.drain[0].dst.as_str(), d.drain[0].keep), ("s3://runs/9/ckpt", 3));
        // Quoted, or inside a word, `#` is part of the argument.
        assert_eq!(d.stage_in[1], Transfer { src: "s3://b/x # y".into(), dst: "odfs:/a#1".into(), seal: false });
        assert_eq!(d.pool.as_deref(), Some("ram#2"));
        assert!(parse("#ODFS # stage-in s3://b/x /d\n", "1", "u").unwrap_err().contains("no directive"));
    }

    #[test]
    fn a_drain_is_also_the_stage_out_of_its_pair() {
        let d = parse(
            "#ODFS drain /ckpt s3://runs/%j/ckpt --settle 5 --keep 3 --marker COMPLETE --max-bandwidth 100M --share 10%\n",
            "9",
            "u",
        )
        .unwrap();
        assert_eq!(
            d.drain,
            [Drain {
                src: "odfs:/ckpt".into(),
                dst: "s3://runs/9/ckpt".into(),
                settle: Some(5.0),
                keep: 3,
                marker: Some("COMPLETE".into()),
                concurrency: None,
                max_bandwidth: Some(100 << 20),
                share: Some(0.1),
                delete_after_upload: false,
            }]
        );
        assert_eq!(d.stage_out, [Transfer { src: "odfs:/ckpt".into(), dst: "s3://runs/9/ckpt".into(), seal: false }]);
        assert!(
            parse("#ODFS drain /c s3://b/c --delete-after-upload --keep 2\n", "1", "u").unwrap().drain[0]
                .delete_after_upload
        );
        // Named twice (drain and stage-out): staged out once.
        let d = parse("#ODFS stage-out /c s3://b/c\n#ODFS drain /c s3://b/c\n", "1", "u").unwrap();
        assert_eq!(d.stage_out.len(), 1);
        for (s, want) in [
            ("#ODFS drain /c\n", "drain takes a source"),
            ("#ODFS drain /c /pfs/out\n", "a drain uploads to s3://"),
            ("#ODFS drain c s3://b/c\n", "not a path in the job's filesystem"),
            ("#ODFS drain /c s3://b/c --settle\n", "--settle needs a value"),
            ("#ODFS drain /c s3://b/c --settle soon\n", "not a number of seconds"),
            ("#ODFS drain /c s3://b/c --keep -1\n", "not a number of checkpoints"),
            ("#ODFS drain /c s3://b/c --marker a/b\n", "drain --marker \"a/b\" is not a file name"),
            ("#ODFS drain /c s3://b/c --delete yes\n", "unknown option \"--delete\""),
            ("#ODFS drain /c s3://b/c --share 0\n", "drain --share \"0\" is not a percentage from 1 to 100"),
            ("#ODFS drain /c s3://b/c --share most\n", "is not a percentage"),
        ] {
            let e = parse(s, "1", "u").unwrap_err();
            assert!(e.contains(want), "{s:?}: {e}");
        }
    }

    #[test]
    fn the_shipped_examples_parse() {
        let t = parse(include_str!("../../../slurm/examples/train.sbatch"), "7", "ana").unwrap();
        assert_eq!(t.stage_out[0].dst, "s3://runs/ana/train-7");
        assert!(t.stage_in[0].seal, "the training example seals its dataset");
        assert_eq!((t.stripe_count, t.chunk_size), (Some(-1), Some(4 << 20)));
        let c = parse(include_str!("../../../slurm/examples/checkpoint.sbatch"), "8", "bo").unwrap();
        assert_eq!(c.pool.as_deref(), Some("ram"));
        let d = parse(include_str!("../../../slurm/examples/drain.sbatch"), "9", "cy").unwrap();
        assert_eq!((d.drain[0].dst.as_str(), d.drain[0].keep, d.drain[0].share), ("s3://runs/cy/9/ckpt", 3, Some(0.1)));
        assert_eq!(d.stage_out.len(), 2, "the drain's pair and /results");
        // The batch script the README shows, comments and all.
        let readme = include_str!("../../../README.md");
        let script = readme
            .split("```sh\n")
            .find(|block| block.starts_with("#!/bin/bash\n#SBATCH"))
            .and_then(|block| block.split("```").next())
            .expect("the README shows a batch script");
        let r = parse(script, "5", "ana").unwrap();
        assert_eq!((r.stage_in.len(), r.stage_out.len(), r.drain.len()), (1, 2, 1));
        assert_eq!(r.drain[0].keep, 3);
    }

    #[test]
    fn errors_name_the_line_and_the_problem() {
        for (s, want) in [
            ("#ODFS stripe-count four\n", "line 1: `#ODFS stripe-count four`: stripe-count \"four\" is not a number"),
            ("#!/bin/sh\n#ODFS stage-in s3://b/x\n", "line 2"),
            ("#ODFS stage-in s3://b/x /d --sealed\n", "stage-in takes a source"),
            ("#ODFS stage-in s3://b/x data\n", "not a path in the job's filesystem"),
            ("#ODFS stage-out /out bucket/x\n", "neither s3://"),
            ("#ODFS stage-in s3:// /d\n", "names no bucket"),
            ("#ODFS stage-in s3://b /../etc\n", "'..'"),
            ("#ODFS chunk-size 1000\n", "power of two"),
            ("#ODFS stripe-count 0\n", "positive count or -1"),
            ("#ODFS frobnicate\n", "unknown directive \"frobnicate\""),
            ("#ODFS\n", "no directive"),
            ("#ODFSstage-in a b\n", "write `#ODFS directive args`"),
            ("#ODFS pool 'ram\n", "quote is not closed"),
            ("#!/bin/sh\nhostname\n#ODFS pool x\n", "line 3: `#ODFS pool x`: #ODFS lines must come before"),
        ] {
            let e = parse(s, "1", "u").unwrap_err();
            assert!(e.contains(want), "{s:?}: {e}");
        }
    }
}
