#pragma once
// The page served at GET /: a prompt box with streaming output, a live view of
// the route (polls /v1/cluster) and buttons for failure injections.

#include <string>

namespace strata::server {

const std::string& page_html();

} // namespace strata::server
