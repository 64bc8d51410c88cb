//! Whose S3 credentials a job's stages use. The prolog and epilog run as root, so they must
//! not lend root's identity to a job: unless the site configures an account for staging
//! (`[stage] credentials_file` or `profile`: the admin's choice, and every job may then read
//! what that account can), a job stages with its user's own `~/.aws/credentials` and
//! `~/.aws/config`, read with the user's permissions (a symlink to a root-only file fails like
//! any file the user cannot read) and copied into the job's root-only state directory for the
//! S3 client. A user without them gets no credentials at all — never root's.

use crate::site::SiteConfig;
use crate::spec::JobUser;
use anyhow::{Context, Result};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Points the S3 client of this process at the right credentials for `user`'s stages, and
/// at `profile` among them (`#ODFS profile`). Returns a line saying which were chosen.
pub fn prepare(site: &SiteConfig, user: &JobUser, job_dir: &Path, profile: Option<&str>) -> Result<String> {
    let said = choose(site, user, job_dir)?;
    if let Some(p) = profile {
        std::env::set_var("AWS_PROFILE", p);
    }
    Ok(said)
}

fn choose(site: &SiteConfig, user: &JobUser, job_dir: &Path) -> Result<String> {
    let st = &site.stage;
    if st.credentials_file.is_some() || st.profile.is_some() {
        check_site_files(site)?;
        return Ok("S3 credentials: the site's ([stage] in the site config)".into());
    }
    // SAFETY: geteuid has no preconditions.
    if user.uid == unsafe { libc::geteuid() } {
        return Ok("S3 credentials: the caller's own".into());
    }
    let home = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(user.uid))
        .ok()
        .flatten()
        .map(|u| u.dir)
        .with_context(|| format!("no home directory for uid {}", user.uid))?;
    let mut found = Vec::new();
    for (name, var) in [("credentials", "AWS_SHARED_CREDENTIALS_FILE"), ("config", "AWS_CONFIG_FILE")] {
        let src = home.join(".aws").join(name);
        let path = src.clone();
        let text = match odfs_stage::posix::as_user_blocking(&user.ctx(), move || std::fs::read(&path)) {
            Ok(t) => {
                found.push(src.display().to_string());
                t
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e).with_context(|| format!("cannot read {} as {}", src.display(), user.name)),
        };
        let copy = job_dir.join(format!("aws-{name}"));
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .mode(0o600)
            .open(&copy)
            .with_context(|| format!("cannot write {}", copy.display()))?;
        std::io::Write::write_all(&mut f, &text)?;
        std::env::set_var(var, &copy);
    }
    // Variables a root shell may carry must not stand in for the user's own.
    for v in ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"] {
        std::env::remove_var(v);
    }
    Ok(if found.is_empty() {
        format!("S3 credentials: none ({} has no ~/.aws/credentials or ~/.aws/config)", user.name)
    } else {
        format!("S3 credentials: {}'s own ({})", user.name, found.join(", "))
    })
}

/// The site's own credentials and config files must be readable here: when they are not, the
/// fault is the site's configuration, and the message says so rather than pointing the user at
/// their own credentials.
fn check_site_files(site: &SiteConfig) -> Result<()> {
    if let Some((key, f, e)) = site.stage.unreadable_files().into_iter().next() {
        anyhow::bail!(
            "the site's S3 {key} {} cannot be read ({e}): this is the site configuration's fault, not \
             the job's; an admin must install that file on every node, or remove [stage] {key} from \
             the site config so that jobs stage with their users' own credentials",
            f.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user() -> JobUser {
        // SAFETY: getuid and getgid have no preconditions.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        JobUser { name: "someone".into(), uid, gid, groups: Vec::new() }
    }

    #[test]
    fn a_missing_site_credentials_file_is_the_sites_fault() {
        let d = tempfile::tempdir().unwrap();
        let mut site = SiteConfig::default();
        site.stage.credentials_file = Some(d.path().join("s3.credentials"));
        let e = format!("{:#}", prepare(&site, &user(), d.path(), None).unwrap_err());
        assert!(e.contains("the site's S3 credentials_file") && e.contains("s3.credentials"), "{e}");
        assert!(e.contains("not the job's") && !e.contains("AWS_ACCESS_KEY_ID"), "{e}");
        std::fs::write(d.path().join("s3.credentials"), "[default]\n").unwrap();
        let said = prepare(&site, &user(), d.path(), None).unwrap();
        assert!(said.contains("the site's"), "{said}");
    }
}
