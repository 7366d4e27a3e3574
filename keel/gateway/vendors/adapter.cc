// The out-of-line parts of the adapter interfaces (vendor.h, front.h) that every vendor folder
// builds on: VendorAdapter's default embeddings answer, JsonPost, and the two registry classes.
// The registries' contents and lookups are in vendor.cc and front.cc.
#include "keel/gateway/front.h"
#include "keel/gateway/vendor.h"

namespace keel::gateway {

void VendorRegistry::Add(std::string name, std::unique_ptr<VendorAdapter> adapter) {
  default_name_.try_emplace(adapter->format(), name);
  by_name_[std::move(name)] = std::move(adapter);
}

const VendorAdapter* VendorRegistry::Find(std::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second.get();
}

std::vector<std::string> VendorRegistry::Names() const {
  std::vector<std::string> names;
  for (const auto& [n, adapter] : by_name_) names.push_back(n);
  return names;
}

std::string_view VendorRegistry::DefaultNameFor(WireFormat format) const {
  auto it = default_name_.find(format);
  return it == default_name_.end() ? std::string_view() : std::string_view(it->second);
}

ClientRequest JsonPost(std::string url, std::string body, bool stream) {
  ClientRequest r;
  r.method = "POST";
  r.url = std::move(url);
  r.body = std::move(body);
  r.headers.emplace_back("Content-Type", "application/json");
  if (stream) r.headers.emplace_back("Accept", "text/event-stream");
  return r;
}

Result<ClientRequest> VendorAdapter::BuildEmbeddings(const UpstreamConfig& up, std::string body) const {
  return Status::NotFound(std::string(WireFormatName(format())) + " upstreams have no OpenAI-shaped embeddings");
}

void FrontRegistry::Add(std::unique_ptr<ClientFront> front) {
  const WireFormat format = front->format();
  by_format_.try_emplace(format, std::move(front));
}

const ClientFront* FrontRegistry::Find(WireFormat format) const {
  auto it = by_format_.find(format);
  return it == by_format_.end() ? nullptr : it->second.get();
}

std::vector<WireFormat> FrontRegistry::Formats() const {
  std::vector<WireFormat> formats;
  for (const auto& [f, front] : by_format_) formats.push_back(f);
  return formats;
}

}  // namespace keel::gateway
