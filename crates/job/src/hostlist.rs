//! Slurm host lists (`n[1-4]`, `gpu[01-08,10],login1`, `r[1-2]-n[1-3]`) expanded into names,
//! in Slurm's order, without asking Slurm: a prolog should not call Slurm commands it can do
//! without.

/// Splits at commas that are not inside brackets.
fn top_level_items(s: &str) -> Result<Vec<&str>, String> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0i32, 0usize);
    for (i, c) in s.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => {
                depth -= 1;
                if depth < 0 {
                    return Err(format!("host list {s:?}: ']' without '['"));
                }
            }
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(format!("host list {s:?}: '[' without ']'"));
    }
    out.push(&s[start..]);
    Ok(out)
}

/// The numbers of one bracket body (`1-3,7,09-10`), as strings keeping zero padding.
fn range_values(body: &str, whole: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for part in body.split(',') {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let bad = || format!("host list {whole:?}: {part:?} is not a number or a range like 1-4");
        if lo.is_empty() || !lo.bytes().all(|b| b.is_ascii_digit()) || !hi.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let (a, b): (u64, u64) = (lo.parse().map_err(|_| bad())?, hi.parse().map_err(|_| bad())?);
        if b < a {
            return Err(format!("host list {whole:?}: range {part:?} runs backwards"));
        }
        if b - a > 100_000 {
            return Err(format!("host list {whole:?}: range {part:?} is too large"));
        }
        let width = lo.len();
        for n in a..=b {
            out.push(format!("{n:0width$}"));
        }
    }
    Ok(out)
}

/// Expands one item (no top-level commas), bracket by bracket.
fn expand_item(item: &str, whole: &str) -> Result<Vec<String>, String> {
    let Some(open) = item.find('[') else { return Ok(vec![item.to_string()]) };
    let close =
        item[open..].find(']').map(|c| open + c).ok_or_else(|| format!("host list {whole:?}: '[' without ']'"))?;
    let prefix = &item[..open];
    let values = range_values(&item[open + 1..close], whole)?;
    let rest = expand_item(&item[close + 1..], whole)?;
    let mut out = Vec::with_capacity(values.len() * rest.len());
    for v in &values {
        for r in &rest {
            out.push(format!("{prefix}{v}{r}"));
        }
    }
    Ok(out)
}

/// Expands a host list into host names, in order. Empty names are refused.
pub fn expand(list: &str) -> Result<Vec<String>, String> {
    let list = list.trim();
    if list.is_empty() {
        return Err("the node list is empty".into());
    }
    let mut out = Vec::new();
    for item in top_level_items(list)? {
        let item = item.trim();
        if item.is_empty() {
            return Err(format!("host list {list:?} has an empty entry"));
        }
        out.extend(expand_item(item, list)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expands_slurm_host_lists() {
        assert_eq!(expand("n[1-4]").unwrap(), ["n1", "n2", "n3", "n4"]);
        assert_eq!(expand("n1").unwrap(), ["n1"]);
        assert_eq!(expand("gpu[08-10],login1").unwrap(), ["gpu08", "gpu09", "gpu10", "login1"]);
        assert_eq!(expand("n[1,3-4]x").unwrap(), ["n1x", "n3x", "n4x"]);
        assert_eq!(expand("r[1-2]-n[1-2]").unwrap(), ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]);
        assert_eq!(expand("10.0.0.1,10.0.0.2").unwrap(), ["10.0.0.1", "10.0.0.2"]);
    }

    #[test]
    fn refuses_malformed_lists() {
        for bad in ["", "n[1-4", "n1-4]", "n[a-b]", "n[4-1]", "a,,b", "n[]"] {
            assert!(expand(bad).is_err(), "{bad:?} must be refused");
        }
    }
}
