//! `odfs-mgmtd`: thin binary over the mgmtd library.

fn main() {
    odfs_service::daemon_main::<odfs_mgmtd::MgmtdConfig, _, _, _>(
        "odfs-mgmtd",
        "odfs management daemon",
        odfs_mgmtd::run,
    );
}
