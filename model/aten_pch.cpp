// Builds the precompiled <ATen/ATen.h> that formats/ and transformer/ reuse
// (model/CMakeLists.txt); holds no code.
