//! Generates the messages and the gRPC client and server from proto/ with protox (a protobuf
//! compiler in Rust: no protoc needed on the machine).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["workload.proto", "authorization.proto", "citadel.proto", "discovery.proto"];
    for p in &protos {
        println!("cargo:rerun-if-changed=proto/{p}");
    }
    let fds = protox::compile(protos, ["proto"])?;
    tonic_build::configure()
        .build_client(true)
        .build_server(true)
        // Addresses are raw bytes; `Bytes` lets a decoded resource share the response's buffer.
        .bytes(["."])
        .compile_fds(fds)?;
    Ok(())
}
